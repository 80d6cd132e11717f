"""Load that cancels: the scheduler's wait time (dtrain.run.hostload), the probe's roofline check
and the local check scaling each run's prediction by the load measured during it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.costmodel.efficiency import fit_curve
from dtrain.results import contract
from dtrain.run import hostload

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"
needs_schedstat = pytest.mark.skipif(
    not hostload.available(), reason="no /proc/<pid>/task/<tid>/schedstat here"
)


def test_load_factor_by_hand():
    s = [
        hostload.Sample(t=10.0, dt=1.0, cpu=2.0, wait=2.0),  # factor 2
        hostload.Sample(t=11.0, dt=1.0, cpu=1.0, wait=2.0),  # factor 3
        hostload.Sample(t=12.0, dt=1.0, cpu=2.0, wait=0.0),  # factor 1
        hostload.Sample(t=20.0, dt=1.0, cpu=2.0, wait=8.0),
    ]  # outside the window
    lf = hostload.load_factor(s, 9.5, 11.5, busy=1, cores=2)
    # (cpu + wait) / cpu over the samples that overlap [9.5, 11.5]: the first three
    assert lf.median == pytest.approx((5 + 4) / 5) and lf.samples == 3
    assert lf.low == pytest.approx(1.2) and lf.high == pytest.approx(
        2.8
    )  # 10th / 90th pct of 1, 2, 3
    # two ranks that wait on each other, which got half a core between them: the top of the spread
    # allows for the cores they did not get, 2 cores x 1 s / 0.5 s of CPU (their own wait says only
    # 2)
    starved = [hostload.Sample(t=10.0, dt=1.0, cpu=0.5, wait=0.5)]
    assert hostload.load_factor(starved, 9.5, 10, busy=2, cores=2) == hostload.LoadFactor(
        2.0, 2.0, 4.0, 1
    )
    # a run with twice as many busy threads as cores waits that much on itself: not other processes'
    # load
    assert hostload.load_factor(s, 9.2, 9.8, busy=4, cores=2).median == 1.0  # the first sample only
    assert hostload.load_factor(s, 30, 40) is None
    # samples with no CPU work (the run had not started) say nothing about its load
    assert hostload.load_factor([hostload.Sample(10.0, 1.0, 0.0, 0.0)], 9, 11) is None


@needs_schedstat
def test_a_cpu_bound_child_ran_or_waited_all_the_time(tmp_path):
    """Whatever the load, a CPU-bound process is either on a CPU or waiting for one: cpu + wait =
    wall."""
    out = tmp_path / "load.jsonl"
    with hostload.Sampler(out, interval=0.1):
        time.sleep(0.2)
        t0 = time.perf_counter()
        # busy 1 s, then asleep 1 s: a process's last interval is lost when it exits, the busy one
        # is not
        subprocess.run(
            [
                sys.executable,
                "-S",
                "-c",
                "import time\nt = time.time()\nwhile time.time() - t < 1: pass\ntime.sleep(1)",
            ],
            check=True,
        )
        lived = (
            time.perf_counter() - t0 - 1
        )  # its 1 s loop plus starting python, longer on a busy host
        time.sleep(0.2)
    samples = hostload.read(out)
    busy = [s for s in samples if s.cpu > 0.05 * s.dt]
    assert busy and 0.8 <= sum(s.cpu + s.wait for s in busy) <= lived + 0.3


@needs_schedstat
def test_contention_times_work_without_the_wait():
    with hostload.Contention() as c:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
            pass
    assert c.factor >= 1.0 and c.idle == pytest.approx(c.wall / c.factor) and c.idle <= c.wall


def test_fit_caps_e_max_above_the_roofline():
    from dtrain.costmodel.gemm_probe import fit

    # fractions that rise past 1: the plain fit puts e_max above the roofline
    pts = [
        {"flops": w, "count": 1, "fraction": f}
        for w, f in ((1e6, 0.5), (4e6, 0.8), (1.6e7, 0.95), (6.4e7, 0.99))
    ]
    assert fit_curve([(p["flops"], p["fraction"]) for p in pts]).e_max > 1.0
    curve = fit(pts)
    assert curve.e_max == 1.0
    # W_half refitted for e_max = 1: weighted least squares of 1/f - 1 = W_half / W, by hand
    num = sum(p["fraction"] ** 2 / p["flops"] * (1 / p["fraction"] - 1) for p in pts)
    den = sum(p["fraction"] ** 2 / p["flops"] ** 2 for p in pts)
    assert curve.w_half == pytest.approx(num / den)


def test_a_gemm_above_the_roofline_is_left_out(tmp_path, monkeypatch):
    """A point faster than the reference matmul is timed again, then left out of the fit and
    listed."""
    from dtrain.costmodel import gemm_probe
    from dtrain.costmodel.probe_timing import gemm_seconds as real

    shutil.copytree(CPU, tmp_path / "r")
    calls = []

    def fake(g, device, dtype, timer):
        calls.append((g.m, g.n, g.k))
        return (
            1e-9 if (g.m, g.n, g.k) == calls[0] else real(g, device, dtype, timer)
        )  # the first: impossibly fast

    monkeypatch.setattr(gemm_probe, "gemm_seconds", fake)
    monkeypatch.setattr(
        gemm_probe, "step_s", lambda t, dev, timer: 0.01
    )  # the overheads are not under test
    out = gemm_probe.probe(tmp_path / "r")
    [g] = contract.read(json.loads((out / "summary.json").read_text()))
    assert calls.count(calls[0]) == 3  # timed, then twice again
    # (on a busy host a real point may be left out too: only the impossible one is certain)
    assert calls[0] in [(p.m, p.n, p.k) for p in g.rejected] and all(
        p.fraction > 1 for p in g.rejected
    )
    assert all((p.m, p.n, p.k) != calls[0] for p in g.points)
    assert g.e_max <= 1.0 and all(p.fraction <= gemm_probe.ABOVE_ROOFLINE for p in g.points)


def test_local_check_scales_each_run_by_its_measured_load(tmp_path, monkeypatch):
    """The same probe with and without a load timeline: a run whose threads waited twice as long
    as they ran (factor 3 over its window) gets a prediction whose compute and fixed overhead
    take 3x as long, and the samples' 10th-90th percentile (factors 2 and 4) as its spread."""
    from dtrain.costmodel import gemm_probe
    from dtrain.costmodel.calibrate import calibrate
    from dtrain.costmodel.probe_timing import Reference
    from dtrain.costmodel.run_loads import LOAD_FILE
    from dtrain.guide.local_check import local_checks

    res = tmp_path / "r"
    shutil.copytree(CPU, res)
    monkeypatch.setattr(
        gemm_probe, "gemm_seconds", lambda g, d, dt, timer: g.flops * g.count / 5e10
    )
    monkeypatch.setattr(gemm_probe, "step_s", lambda t, dev, timer: 0.05)
    # the reference matmul at one fixed rate: the two probes then differ only by the load timeline
    # (a live reference on a busy CI host made the second probe's curve differ from the first's)
    monkeypatch.setattr(Reference, "now", lambda self: (self.rates.append(1e11), 1e11)[1])
    gemm_probe.probe(res)
    idle = {(c.run, c.what): c for c in local_checks(calibrate([res], warn=False))}
    shutil.rmtree(res / "gemm-probe")
    # two samples covering every run's window: factors 2 and 4, 3 over both
    now = time.time()
    (res / LOAD_FILE).write_text(
        json.dumps({"t": now + 10, "dt": now, "cpu": now, "wait": now})
        + "\n"  # since 1970: a core busy
        + json.dumps({"t": now + 11, "dt": now, "cpu": now, "wait": 3 * now})
        + "\n"
    )
    out = gemm_probe.probe(res)
    [g] = contract.read(json.loads((out / "summary.json").read_text()))
    assert g.loads and all(
        (ld.load_factor, ld.low, ld.high) == pytest.approx((3.0, 2.2, 3.8)) for ld in g.loads
    )
    loaded = local_checks(calibrate([res], warn=False))
    fsdp = [c for c in loaded if c.experiment == "fsdp-scaling"]
    assert fsdp and all("load x3.00 measured during the run (2.20-3.80)" in c.basis for c in fsdp)
    for c in fsdp:
        base = idle[(c.run, c.what)].predicted_s
        assert (
            1.5 * base < c.predicted_s <= 3.0 * base + 1e-9
        )  # compute and overhead x3, communication not
        lo, hi = c.predicted_range
        assert lo < c.predicted_s < hi
