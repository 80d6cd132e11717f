"""Uncertainty beside each decision: tie and memory-risk markers from the backtest's error band
(the guide's matrix and long-context table, `dtrain plan`'s text), and the figures they use."""

from types import SimpleNamespace

import pytest

from dtrain.costmodel.backtest import backtest, summary
from dtrain.costmodel.backtest_cli import text_lines
from dtrain.costmodel.hardware import GiB
from dtrain.costmodel.plan_text import uncertainty_lines
from dtrain.costmodel.uncertainty import PLAN_BAND, ErrorBand
from dtrain.guide.long_context import LongCell, long_context_section
from dtrain.guide.matrix import Cell, cell_text
from dtrain.guide.matrix_section import uncertainty_note

BAND = ErrorBand(time=0.087, memory_low=-0.21, memory_high=0.08, rows=55, memory_rows=18)


@pytest.fixture(scope="module")
def rows():
    return backtest(rank=False)


def _cell(**kw) -> Cell:
    base = dict(model="7B", params=7e9, gpus=64, topology="NVLink", ib_gbit=400, fits=True)
    base.update(dp=8, tp=8, pp=1, zero=1, recompute="none", micro_batch=1, mfu=0.4)
    base.update(mem_gib=50.0, tokens_per_s=1000.0, hbm_gib=80.0, runner_up="16×4×1")
    return Cell(**{**base, **kw})


def test_the_plan_band_is_the_backtests(rows):
    s, band = summary(rows), ErrorBand.from_rows(rows)
    assert band.time == s["median_abs_error"] and band.rows == s["rows"]
    assert (band.memory_low, band.memory_high) == s["memory_error_range"]
    # the constants `dtrain plan` uses are these figures, rounded as their comment states them
    assert PLAN_BAND.time == pytest.approx(band.time, abs=5e-4)
    assert PLAN_BAND.memory_low == pytest.approx(band.memory_low, abs=5e-3)
    assert PLAN_BAND.memory_high == pytest.approx(band.memory_high, abs=5e-3)
    assert (PLAN_BAND.rows, PLAN_BAND.memory_rows) == (band.rows, band.memory_rows)


def test_tie_marker_exactly_within_the_band():
    edge = 1000.0 * (1 - BAND.time)
    for tps, tie in ((999.0, True), (edge + 0.01, True), (edge - 0.5, False), (500.0, False)):
        text = cell_text(_cell(runner_up_tps=tps), BAND)
        assert ("≈" in text) is tie, (tps, text)
        assert ("16×4×1" in text) is tie
    assert cell_text(_cell(runner_up_tps=999.0), BAND).endswith("<br>≈ 16×4×1 0.1% slower")
    assert "≈" not in cell_text(_cell(runner_up="", runner_up_tps=0.0), BAND)
    assert cell_text(_cell(runner_up_tps=999.0)) == "8×8×1 Z1 mb1<br>40% · 50 GiB"  # no band


def test_memory_marker_within_the_band_of_hbm():
    limit = 80.0 * (1 + BAND.memory_low)  # 63.2 GiB: at −21% the peak would pass 80 GiB
    for mem, risk in ((limit + 0.1, True), (72.0, True), (limit - 0.1, False), (35.0, False)):
        text = cell_text(_cell(mem_gib=mem, runner_up_tps=1.0), BAND)
        assert ("⚠" in text) is risk, (mem, text)
    cells = [
        LongCell("70B", 131072, 512, "dp4 cp8 tp8 pp2 Z1", 8, 0.6, 71.0, 1000.0, "p", 950.0),
        LongCell("8B", 4096, 64, "dp64 tp1 pp1 Z1", 1, 0.6, 40.0, 1000.0, "p", 1000.0),
        LongCell("8B", 32768, 64, "dp8 cp8 tp1 pp1 Z1", 8, 0.7, 40.0, 1000.0, "p", 500.0),
    ]
    table = [x for x in long_context_section(cells, BAND, 80.0) if x.startswith("| ")][1:]
    assert "71 GiB ⚠" in table[0] and "+5% ≈" in table[0]
    assert "⚠" not in table[1] + table[2] and "+100% |" in table[2]


def test_plan_marks_ties_and_memory_risk():
    def plan(tps, tp, mem=50 * GiB):
        t = SimpleNamespace(tokens_per_s=tps)
        return SimpleNamespace(
            tp=tp, pp=1, zero_stage=1, recompute="none", time=t, memory=SimpleNamespace(total=mem)
        )

    def res(best, *others):
        cluster = SimpleNamespace(gpu=SimpleNamespace(hbm_bytes=80 * GiB))
        return SimpleNamespace(best=best, ranked=[best, *others], cluster=cluster)

    lines = uncertainty_lines(res(plan(1000, 1), plan(999, 2), plan(800, 4)), 5, BAND)
    assert len(lines) == 1 and "1 runner-up(s) within the backtest's median" in lines[0]
    assert "8.7%" in lines[0]
    assert uncertainty_lines(res(plan(1000, 1), plan(800, 2)), 5, BAND) == []
    lines = uncertainty_lines(res(plan(1000, 1, 71 * GiB), plan(800, 2)), 5, BAND)
    assert len(lines) == 1 and lines[0].startswith("  memory risk at the memory check's -21%")
    assert "the peak is 90 GiB > 80 GiB HBM" in lines[0]
    assert max(len(x) for x in lines) <= 100


def test_guide_states_the_figures_it_used(rows):
    band = ErrorBand.from_rows(rows)
    note = " ".join(uncertainty_note(band, [_cell(runner_up_tps=999.0, mem_gib=72.0)]))
    s = summary(rows)
    assert f"median |error| of {s['median_abs_error']:.1%}" in note
    lo, hi = s["memory_error_range"]
    assert f"{lo:+.0%} to {hi:+.0%}" in note and f"{s['memory_rows']} rows" in note
    assert "1 of 1 cells that fit carry `≈`, 1 carry `⚠`" in note


def test_backtest_gap_claims_are_qualified():
    loso = "\n".join(text_lines(backtest(rank=True)))
    assert "a gap is the model's prediction, not a measurement" in loso
    assert "measure before switching" in loso
