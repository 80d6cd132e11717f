"""This host as the cost model's cluster, for the local check's rows (``local_check``): one 'GPU'
per rank at the measured peak and one link (``host_cluster``), the trainer's software stack
(``TRAINER``), how busy the host's cores are (``oversubscription``, ``free_core_share``), the step
the cost model predicts on it (``host_step``) and that step's spread under the measured load
(``_spread``)."""

from __future__ import annotations

from dataclasses import replace

from dtrain.costmodel import (
    Calibration,
    Cluster,
    GPUProfile,
    Layout,
    LinkModel,
    ModelShape,
    Param,
    StepTime,
    step_time,
)
from dtrain.costmodel.stack import Stack

# the local runs are this project's trainer: its layouts as it runs them (costmodel/software.py,
# "dtrain": FSDP2's ZeRO-2 gathers the weights again for every micro-batch)
TRAINER = Stack(software="dtrain")


def host_cluster(peak_flops: float, world: int, link: LinkModel) -> Cluster:
    """This host as the cost model's cluster: one 'GPU' per rank at the measured peak, one link."""
    gbps = link.beta_Bps / 1e9
    prof = GPUProfile(
        "host",
        peak_flops / 1e12,
        peak_flops / 1e12,
        1e6,
        0.0,
        gbps,
        2 * gbps,
        world,
        0,
        gbps,
        gbps * 8,
        "measured",
    )
    return Cluster(world, world, prof, link, link)


def oversubscription(env: dict, world: int) -> float:
    """Busy threads per core, at least 1: ranks · threads_per_rank / the host's cores (env.json).
    With more threads than cores the ranks' compute is time-sliced, so each runs that many times
    slower than the matmul probe it measured alone."""
    cores = int(env.get("cpu_count") or 0)
    threads = int(env.get("threads_per_rank") or 1)
    return max(1.0, world * threads / cores) if cores else 1.0


def free_core_share(env: dict, world: int) -> float:
    """Share of the host's cores not busy with the ranks' compute threads, max(0, 1 −
    ranks·threads / cores). Hidden DP traffic is only free where a core is: gloo's threads copy
    and reduce on the CPU (as NCCL's kernels take SMs, ``Calibration.dp_overlap``), so on a host
    whose cores all compute, a collective that overlaps compute takes its time from it. The local
    rows scale the measured overlap by this share."""
    cores = int(env.get("cpu_count") or 0)
    threads = int(env.get("threads_per_rank") or 1)
    return max(0.0, 1.0 - world * threads / cores) if cores else 1.0


def host_step(
    shape: ModelShape,
    layout: Layout,
    calib: Calibration,
    *,
    peak: float,
    world: int,
    link: LinkModel | None,
    value_bytes: int,
    overhead_s: float | None = None,
    precision: str = "bf16",
) -> StepTime:
    """The cost model's step on this host (``host_cluster``: ``world`` ranks at ``peak`` each, the
    local link; none measured: a free one). ``overhead_s``: the probe's fixed step overhead as
    slowed on these cores, in place of ``calib``'s."""
    if overhead_s is not None:
        calib = replace(calib, step_overhead_s=Param(overhead_s, calib.step_overhead_s.provenance))
    cluster = host_cluster(peak, world, link or LinkModel(0, 1e30))
    return step_time(
        shape, layout, cluster, calib, precision=precision, value_bytes=value_bytes, stack=TRAINER
    )


def _spread(step, spread: tuple[float, float] | None) -> tuple[float, float] | None:
    """The predicted totals at the load's 10th and 90th percentile (``step(load=...)``), if
    measured."""
    return spread and (step(load=spread[0]).total, step(load=spread[1]).total)
