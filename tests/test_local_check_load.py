"""Issue 40 item 4: the local check under load. A run that ran on a loaded host (its measured load
factor above MAX_LOAD, or its 10th-90th percentile spread wider than MAX_LOAD_SPREAD) is shown but
not judged; when too few rows can be judged the guide says the check could not be made and quotes
the last valid verdict (``docs/guide/local-check.json``, one of the guide's own files) with its
date."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dtrain.costmodel.calibrate import calibrate
from dtrain.guide.check import (
    MAX_LOAD,
    VERDICT_FILE,
    Check,
    Verdict,
    load_verdict,
    verdict,
)
from dtrain.guide.figures import MANIFEST, ours
from dtrain.guide.guide_cli import keep_verdict
from dtrain.guide.local_check import local_checks
from dtrain.guide.checks_section import checks_table

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"
QUIET = (1.03, 1.01, 1.66)  # the real idle capstone's widest: judged
LOADED = (2.3, 1.9, 3.1)  # three busy loops on two cores


def _rows(loads: list) -> list[Check]:
    return [
        Check(
            "fsdp-scaling",
            f"r{i}",
            f"ddp x{i} step",
            0.100,
            p,
            "probe",
            "",
            (p * 0.9, p),
            load=load,
        )
        for i, (p, load) in enumerate(loads)
    ]


def _report():
    return calibrate([CPU], base=CPU.parent, warn=False)


def test_a_loaded_run_is_not_judged_and_not_counted():
    rows = _rows([(0.105, QUIET), (0.105, None), (0.300, LOADED), (0.090, QUIET)])
    assert [c.judged for c in rows] == [True, True, False, True]
    assert "x2.30 during the run" in rows[2].not_judged and rows[0].not_judged == ""
    assert not replace(rows[0], load=(MAX_LOAD + 0.1, 1.4, 1.8)).judged  # median too high
    assert not replace(rows[0], load=(1.2, 1.0, 2.0)).judged  # spread too wide
    v = verdict(rows)
    assert (v.within, v.judged, v.rows) == (3, 3, 4)  # the loaded +200% row is not a miss
    text = "\n".join(checks_table(rows, _report()))
    assert "**3 of 3 within the goal (1 not judged: loaded host).**" in text
    [loaded] = [line for line in text.splitlines() if "`r2`" in line]
    assert "(not judged)" in loaded and "not judged: the host was loaded (x2.30" in loaded
    assert "✗" not in loaded and "(270–300)" not in loaded  # no verdict, no band


def test_a_verdict_under_load_falls_back_to_the_stored_one(tmp_path):
    report = _report()
    quiet = _rows([(0.105, QUIET), (0.105, QUIET), (0.300, QUIET)])
    assert keep_verdict(report, quiet, tmp_path, "results/capstone/a") is None  # made: stored
    stored = load_verdict(tmp_path)
    assert (stored.within, stored.judged, stored.results) == (2, 3, "results/capstone/a")
    assert stored.date  # the newest checked run's date
    assert ours(tmp_path, VERDICT_FILE)  # listed in the guide's manifest
    assert VERDICT_FILE in json.loads((tmp_path / MANIFEST).read_text())["plots"]

    loaded = _rows([(0.105, LOADED), (0.300, LOADED), (0.105, QUIET)])
    assert verdict(loaded) is None
    kept = keep_verdict(report, loaded, tmp_path, "results/capstone/b")
    assert kept == stored and load_verdict(tmp_path) == stored  # not overwritten
    text = "\n".join(checks_table(loaded, report, kept))
    assert "**The check could not be made under this load:** only 1 of 3 rows" in text
    assert (
        f"The last valid verdict, made on runs of {stored.date} (results/capstone/a): "
        "**2 of 3 within the goal.**"
    ) in text
    assert "±" not in text and "of 3 within the goal.**" not in text.split("last valid")[0]

    # a verdict file the guide did not write (or changed since) is not quoted
    (tmp_path / VERDICT_FILE).write_text(json.dumps({**stored.__dict__, "within": 3}))
    assert keep_verdict(report, loaded, tmp_path, "x") is None
    text = "\n".join(checks_table(loaded, report, None))
    assert "No earlier verdict is stored" in text


def test_quiet_runs_are_judged_as_before():
    report = _report()
    checks = local_checks(report, CPU.parent)
    assert checks and all(c.judged for c in checks)
    v = verdict(checks)
    assert (v.within, v.judged, v.rows) == (
        sum(c.within_goal for c in checks),
        len(checks),
        len(checks),
    )
    text = "\n".join(checks_table(checks, report))
    assert f"**{v.within} of {len(checks)} within the goal.**" in text
    assert "not judged" not in text


def test_verdict_text_round_trips():
    v = Verdict(9, 12, 12, "2026-11-27", "results/capstone/x")
    assert v.text == "9 of 12 within the goal"
    assert Verdict(3, 6, 12, "", "").text == "3 of 6 within the goal (6 not judged: loaded host)"
