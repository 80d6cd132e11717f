"""The local check's physics: per-collective α–β, cores shared by compute and gloo, FP8 as a
whole-step factor. Hand-computed values (see common/dtrain/guide/local_check.py and
costmodel/timemodel.py)."""

from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.costmodel import Calibration, LinkModel, Param, step_time
from dtrain.costmodel.calibrate import calibrate
from dtrain.costmodel.collectives import (
    all_gather_time,
    allreduce_time,
    p2p_time,
    reduce_scatter_time,
)
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.guide.local_host import free_core_share, host_cluster

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"


def test_a_collective_measured_apart_uses_its_own_alpha_beta():
    link = LinkModel(1e-4, 1e9, "host", (("all_gather", 2e-4, 0.5e9), ("sendrecv", 5e-5, 2e9)))
    mb = 8e6
    # all_gather over 4 ranks: 3/4 · B / 0.5 GB/s + 3 · 200 µs
    assert all_gather_time(mb, 4, link) == pytest.approx(0.75 * mb / 0.5e9 + 3 * 2e-4)
    # reduce_scatter was not measured apart: the link's own (all-reduce) α–β
    assert reduce_scatter_time(mb, 4, link) == pytest.approx(0.75 * mb / 1e9 + 3 * 1e-4)
    assert allreduce_time(mb, 4, link) == pytest.approx(1.5 * mb / 1e9 + 6 * 1e-4)
    assert p2p_time(mb, link) == pytest.approx(mb / 2e9 + 5e-5)
    with pytest.raises(ValueError, match="collectives need alpha >= 0 and beta > 0"):
        LinkModel(1e-4, 1e9, "bad", (("all_gather", 1e-4, 0.0),))


def test_allreduce_bench_fits_become_the_local_links_per_collective():
    rep = calibrate([CPU], warn=False)
    link = rep.local_links["intra"]
    ag = link.of("all_gather")
    # the fixture's all_gather fit: 48 µs for a whole 2-rank all_gather = 1 ring hop, 1.9 GB/s bus
    # bandwidth
    assert (ag.alpha_s, ag.beta_Bps) == (pytest.approx(48e-6), pytest.approx(1.9e9))
    assert link.of("reduce_scatter") is link  # not fitted in the fixture: the all-reduce α–β
    assert (link.alpha_s, link.beta_Bps) == (pytest.approx(31.25e-6), pytest.approx(1.6e9))


def test_free_core_share_by_hand():
    assert free_core_share({"cpu_count": 2, "threads_per_rank": 1}, 2) == 0.0
    assert free_core_share({"cpu_count": 16, "threads_per_rank": 4}, 2) == 0.5
    assert (
        free_core_share({"cpu_count": 2, "threads_per_rank": 1}, 4) == 0.0
    )  # oversubscribed: none free
    assert free_core_share({}, 2) == 1.0  # unknown host: the measured overlap as is


def test_fp8_factor_divides_the_whole_step_it_was_measured_on():
    shape = ModelShape(2, 64, 4, 4, 256, 64)
    lay = Layout(micro_batch=8)
    cluster = host_cluster(1e11, 1, LinkModel(1e-4, 1e9))
    calib = replace(
        Calibration(),
        step_overhead_s=Param(0.01, "measured here: test"),
        fp8_speedup=Param(0.5, "measured here: test"),
    )
    base = step_time(shape, lay, cluster, calib, precision="bf16")
    fp8 = step_time(shape, lay, cluster, calib, precision="fp8")
    # a 0.5x tokens/s ratio doubles compute and the fixed overhead alike (no communication on one
    # rank)
    assert fp8.total == pytest.approx(2 * base.total)
    assert fp8.overhead == pytest.approx(0.02)
