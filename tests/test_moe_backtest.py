"""`dtrain backtest --moe` (issue 41): rows only from the released sources, each cited; reported
rates converted as the sources state them; leave-one-source-out fits; the CLI's summary."""

from __future__ import annotations

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel.moe_backtest import (
    load_moe_rows,
    moe_backtest,
    moe_loso_fits,
    moe_setup,
    moe_summary,
    reported_tps,
)

RELEASED = {"nemo-automodel", "megatron-moe-readme", "deepseek-v3-report", "deepseek-v2-report"}


def test_rows_come_from_released_sources_and_cite_them():
    rows = load_moe_rows()
    assert rows
    for r in rows:
        assert r["group"] in RELEASED, r["name"]
        assert len(r["source"]) > 40 and r["reported"]


def test_reported_rates_by_hand():
    by = {r["name"]: r for r in load_moe_rows()}
    v3 = next(r for n, r in by.items() if n.startswith("DeepSeek-V3 pre-training"))
    # 180K H800 GPU hours per trillion tokens -> 1e12 / (180e3 · 3600) tokens/s per GPU
    assert reported_tps(v3, moe_setup(v3).model) == pytest.approx(1543.2, abs=0.1)
    mixtral = next(r for n, r in by.items() if "Mixtral" in n)
    model = moe_setup(mixtral).model
    assert reported_tps(mixtral, model) == pytest.approx(468e12 / model.flops_per_token())


def test_layouts_fold_ep_and_use_every_gpu():
    for r in load_moe_rows():
        s = moe_setup(r)
        assert s.layout.gpus == r["gpus"]
        assert s.layout.ep == r["layout"]["ep"] and s.model.moe.experts % s.layout.ep == 0


def test_leave_one_source_out_fits_every_source():
    rows = load_moe_rows()
    fits = moe_loso_fits(rows)
    assert set(fits) == {r["group"] for r in rows}
    for f in fits.values():
        assert set(f) == {"dp_overlap", "link_efficiency"}


def test_summary_and_cli(capsys):
    rows = moe_backtest()
    s = moe_summary(rows)
    assert s["rows"] == len(load_moe_rows())
    assert 0 < s["median_abs_error"] < 1
    assert main(["backtest", "--moe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["rows"] == s["rows"]
    assert main(["backtest", "--moe"]) == 0
    text = capsys.readouterr().out
    assert "MoE: median |error|" in text
    assert all(len(line) <= 100 for line in text.splitlines())
