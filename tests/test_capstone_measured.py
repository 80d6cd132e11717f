"""`dtrain capstone --measured`: the committed GPU measurements the guide reads besides the
capstone's runs."""

from __future__ import annotations

import pytest

from dtrain.cli.capstone import gpu_measurements
from dtrain.core.errors import UserError


def test_measured_folder_is_read_when_present_and_refused_when_named_but_missing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert gpu_measurements("measured") == []  # the default, in a checkout without measured/
    assert gpu_measurements("none") == []
    (tmp_path / "measured").mkdir()
    assert gpu_measurements("measured") == ["measured"]
    with pytest.raises(UserError, match=r"--measured nope: no such folder: .* or --measured none"):
        gpu_measurements("nope")
    from dtrain.cli.main import main

    assert main(["capstone", "--measured", "nope", "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --measured nope: no such folder: give the folder `make gpu-check` reports were "
        "copied to, or --measured none"
    ]
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_each_gpu_is_calibrated_from_its_own_report_and_this_machine_from_its_own_runs():
    """measured/ holds an H100 report and a later H200 one: planning for either GPU reads its own
    probe (the later H200 one must not stand in for the H100), and with no such GPU the newest
    GPU report."""
    from pathlib import Path

    from dtrain.costmodel.calibrate import calibrate

    measured = Path(__file__).resolve().parents[1] / "measured"
    for gpu, folder in (
        ("h100-sxm", "h100-sxm"),
        ("h200", "h200"),
        ("a100-80gb", "h200"),
        (None, "h200"),
    ):
        report = calibrate([measured], base=measured, warn=False, gpu=gpu)
        assert report.cluster.mfu.provenance.startswith(f"measured here: {folder}/"), (
            gpu,
            report.cluster.mfu.provenance,
        )
    # only GPU runs: this machine's column falls back to them (the newest)
    assert calibrate([measured], base=measured, warn=False).local.mfu.provenance.startswith(
        "measured here: h200/"
    )
