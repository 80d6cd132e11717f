"""dtrain.model.timing: statistics against hand values; warmup and iteration counts."""

import time

import pytest

from dtrain.model.timing import Stopwatch, TimingStats, time_fn


def test_stats_by_hand():
    s = TimingStats([0.3, 0.1, 0.2, 0.6])
    assert s.median == pytest.approx(0.25) and s.mean == pytest.approx(0.3)
    assert s.min == 0.1 and s.max == 0.6
    assert s.std == pytest.approx(((0.0 + 0.04 + 0.01 + 0.09) / 4) ** 0.5)
    assert s.to_dict()["iters"] == 4


def test_time_fn_runs_warmup_then_iters():
    calls = []
    stats = time_fn(lambda: calls.append(1), warmup=2, iters=5)
    assert len(calls) == 7 and len(stats.samples_s) == 5


def test_stopwatch_measures_sleep():
    w = Stopwatch("cpu")
    w.start()
    time.sleep(0.05)
    assert 0.045 <= w.stop() < 5.0  # seconds, not ms; the bound leaves room for a loaded machine
