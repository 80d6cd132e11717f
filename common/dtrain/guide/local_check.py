"""Predicted vs measured step time for the local runs: does the cost model describe this machine?

Each run is predicted with ``dtrain.costmodel.step_time`` on a "cluster" made of this host: the
peak is the run's measured CPU matmul probe (or the GPU datasheet), the link the α–β that
allreduce-bench fitted on the same kind of device. The empirical inputs come from the *other*
experiments wherever possible, so most rows are real out-of-sample predictions:

  compute              with a gemm-probe run (``dtrain.costmodel.gemm_probe``, which capstone runs):
                       the GEMM roofline × achieved-fraction curve fitted over the runs' own GEMM
                       shapes plus the probe's measured fixed per-step overhead of the same model
                       (no step time of the checked runs is used); without one, the compute
                       efficiency of fsdp-scaling (leave-one-out over its runs)
  TP communication     α–β of allreduce-bench × the measured/modelled TP ratio of the OTHER runs
                       (tp-attention and fsdp-scaling's TP layout runs,
                       ``calibration_records.leave_one_out``:
                       never the row's own run); raw α–β when no other run measured it
  PP bubble            the bubble formula × the measured/formula ratio of the other PP layout runs
                       (leave-one-out, as above); the formula as is when there is none
  DP overlap           fsdp-scaling's measured overlap of the other runs (in-sample with one run),
                       times
                       the share of cores the ranks' compute leaves free (``free_core_share``)
  links                allreduce-bench's α–β per collective: all-reduce, and all_gather,
                       reduce_scatter
                       and send/recv where it fitted them (``LinkModel.of``)
  FP8 speed factor     fp8-train compare (in-sample for the fp8 rows: it measured those runs)
  shared cores         a run with more busy threads (ranks x threads_per_rank) than the host's cores
                       computes that many times slower: its peak is divided, its overhead multiplied
                       by ranks·threads / cores (``oversubscription``)
  other load           with a gemm-probe that has the run's load factor (the CPU time other
                       processes took during the run's timed steps, ``dtrain.run.hostload``):
                       the probe's idle reference rate divided, its overhead multiplied by that
                       factor, so load that slowed the run slows its prediction alike; the
                       factor's 10th-90th percentile over the window gives the prediction's
                       spread (``Check.predicted_range``)
Rows say which inputs were in-sample or left out. Goal: |error| <= 15%.

This module gathers the rows (``local_checks``), each run once (``distinct_runs``). The host as a
cluster: ``local_host``; the runs, probe and calibration a row reads: ``local_inputs``; the rows of
the dense training runs: ``fsdp_check``; of the numerics-recipe runs: ``fp8_check``; of the TP
layer runs: ``tp_check``; of the MoE run: ``moe_check``.
"""

from __future__ import annotations

import json
from dataclasses import replace

from dtrain.costmodel.calibrate import CalibrationReport, display_path
from dtrain.costmodel.calibration_records import RunInputs

from .check import Check
from .fp8_check import fp8_checks
from .fsdp_check import fsdp_checks
from .local_inputs import _fsdp_runs, _probe
from .tp_check import tp_checks


def _content_key(ri: RunInputs) -> str:
    """What a run measured: its summary's guide inputs, canonical. A copied run folder has the same;
    a rerun of the same config measures other times (two real runs are two checks, and the guide
    compares them as run-to-run noise)."""
    inputs = ri.run.summary.get("guide_inputs")
    return json.dumps(inputs, sort_keys=True) if inputs else f"path:{ri.run.path}"


def distinct_runs(report: CalibrationReport, base=None) -> tuple[CalibrationReport, dict]:
    """``report`` with each measurement once, and {kept run's display path: the display paths of
    the folders that repeat its guide inputs (copies), left out}: 300 copies of one run are one
    check, not 300, and a copy is no "other run" for the leave-one-out factors. The first in path
    order is kept."""
    kept: dict[str, RunInputs] = {}
    copies: dict[str, list[RunInputs]] = {}
    for ri in report.inputs:
        first = kept.setdefault(_content_key(ri), ri)
        if first is not ri:
            copies.setdefault(display_path(first.run.path, base), []).append(ri)
    if not copies:
        return report, {}
    dropped = {ri.source.run for runs in copies.values() for ri in runs}
    distinct = replace(
        report,
        inputs=list(kept.values()),
        candidates=[c for c in report.candidates if c.source.run not in dropped],
    )
    return distinct, {
        run: tuple(display_path(ri.run.path, base) for ri in runs) for run, runs in copies.items()
    }


def local_checks(report: CalibrationReport, base=None) -> list[Check]:
    """Every local (non-CUDA) run the model can predict, in a stable order; a run's copies
    (``distinct_runs``) are checked once, its rows naming them (``Check.copies``)."""
    report, copies = distinct_runs(report, base)
    link = report.local_links.get("intra")
    if link is not None and report.local_sources["intra"].on_gpu:
        link = None  # a GPU link does not describe CPU ranks
    runs = [r for r in _fsdp_runs(report, base) if not r.on_gpu]
    probe = _probe(report, base)
    checks = (
        fsdp_checks(runs, link, probe, report.candidates)
        + fp8_checks(report, runs, link, base, probe)
        + tp_checks(report, runs, link, base, probe)
    )
    checks = [replace(c, copies=copies.get(c.run, ())) for c in checks]
    return sorted(checks, key=lambda c: (c.experiment, c.run, c.what))
