"""The decision matrix: the cost model's best layout for every (model, GPUs, topology, IB) cell.

Grid: the 7 published model shapes of ``dtrain.guide.models`` (1B–405B) × 6 GPU counts
(8–4096) × 2 node topologies (8 GPUs on NVLink, 8 GPUs on PCIe only) × 4 InfiniBand rates
(100–800 Gbit/s per GPU) = 336 searches, one GPU type (H100 SXM by default), a global batch of 1024
sequences of 4096 tokens (4M tokens, the order of Llama-scale pre-training batches), BF16. The PCIe
node has the same GPU with GPU-to-GPU traffic over its PCIe x16 link instead of NVLink, so the two
topologies differ only in the link.
``search(prune=True)`` keeps it to seconds.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass, replace

from dtrain.costmodel import Calibration, Cluster, LinkModel, search
from dtrain.costmodel.calibrate import LinkCalibration
from dtrain.costmodel.hardware import GiB
from dtrain.costmodel.uncertainty import ErrorBand

from .models import MATRIX_MODELS as MODELS
from .models import model_label, shape as model_shape

GPU_COUNTS = (8, 16, 64, 256, 1024, 4096)
TOPOLOGIES = ("NVLink", "PCIe")
IB_GBITS = (100, 200, 400, 800)
GLOBAL_BATCH = 1024
SEQ_LEN = 4096
GPUS_PER_NODE = 8

RECOMPUTE_LABEL = {"op": "op rc", "selective": "sel rc", "full": "full rc"}  # matrix cell knobs


@dataclass(frozen=True)
class Cell:
    model: str  # "70B"
    params: float  # nominal
    gpus: int
    topology: str  # NVLink | PCIe
    ib_gbit: int
    fits: bool
    dp: int = 0
    tp: int = 0
    pp: int = 0
    virtual_stages: int = 1
    zero: int = 0
    recompute: str = ""
    micro_batch: int = 0
    sequence_parallel: bool = False
    mfu: float = 0.0
    mem_gib: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    parts: tuple = ()  # (compute, tp_comm, pp_comm, bubble, dp exposed) seconds
    mem_parts: tuple = ()  # (params, grads, optimizer, activations, buffers) GiB
    hbm_gib: float = 0.0  # the GPU's HBM (the memory-risk marker's limit)
    runner_up: str = ""  # the fastest plan of another DP×TP×PP layout ("" when none fits)
    runner_up_tps: float = 0.0  # its tokens/s

    @property
    def layout(self) -> str:
        return f"{self.dp}×{self.tp}×{self.pp}"


def cluster_for(
    gpu: str, gpus: int, topology: str, ib_gbit: float, links: LinkCalibration | None
) -> Cluster:
    c = Cluster.from_profile(gpu, gpus, GPUS_PER_NODE, ib_gbit_per_gpu=ib_gbit)
    if topology == "PCIe":
        c = replace(c, nvlink=LinkModel(c.nvlink.alpha_s, c.gpu.pcie_gbps_per_dir * 1e9, "PCIe"))
    elif c.nvlink.name != "NVLink":
        raise ValueError(f"{gpu} has no 8-GPU NVLink domain; use the PCIe topology")
    return links.apply(c) if links else c


def cell(
    params: float,
    gpus: int,
    topology: str,
    ib: int,
    gpu: str,
    calib: Calibration,
    links: LinkCalibration | None,
) -> Cell:
    shape = model_shape(params, SEQ_LEN)
    res = search(
        shape,
        cluster_for(gpu, gpus, topology, ib, links),
        GLOBAL_BATCH,
        calib,
        prune=True,
        keep_within=1.0,
    )
    key = dict(model=model_label(params), params=params, gpus=gpus, topology=topology, ib_gbit=ib)
    b = res.best
    if b is None:
        return Cell(**key, fits=False)
    t, m = b.time, b.memory
    other = next((p for p in res.ranked if (p.dp, p.tp, p.pp) != (b.dp, b.tp, b.pp)), None)
    return Cell(
        **key,
        fits=True,
        dp=b.dp,
        tp=b.tp,
        pp=b.pp,
        virtual_stages=b.virtual_stages,
        zero=b.zero_stage,
        recompute=b.recompute,
        micro_batch=b.micro_batch,
        sequence_parallel=b.sequence_parallel,
        mfu=t.mfu,
        mem_gib=m.total / GiB,
        step_s=t.total,
        tokens_per_s=t.tokens_per_s,
        parts=(t.compute, t.tp_comm, t.pp_comm, t.bubble, t.dp_comm_exposed),
        mem_parts=tuple(
            x / GiB for x in (m.params, m.grads, m.optimizer, m.activations, m.buffers)
        ),
        hbm_gib=res.cluster.gpu.hbm_bytes / GiB,
        runner_up=f"{other.dp}×{other.tp}×{other.pp}" if other else "",
        runner_up_tps=other.time.tokens_per_s if other else 0.0,
    )


def _cell(args) -> Cell:
    return cell(*args)


def compute_matrix(
    calib: Calibration,
    links: LinkCalibration | None = None,
    gpu: str = "h100-sxm",
    progress=None,
    workers: int | None = None,
    pool=None,
) -> list[Cell]:
    """Every cell in a fixed order (model, GPUs, topology, IB). ``progress(n_done, n_total)``.
    The searches are independent: ``workers`` processes (default: the usable cores, at most 8)
    run them side by side, or the caller's ``pool`` (kept open)."""
    grid = [
        (p, g, t, ib, gpu, calib, links)
        for p in MODELS
        for g in GPU_COUNTS
        for t in TOPOLOGIES
        for ib in IB_GBITS
    ]
    workers = workers or min(len(os.sched_getaffinity(0)), 8)
    cells = []
    chunk = len(TOPOLOGIES) * len(
        IB_GBITS
    )  # one (model, GPUs) per task: its layouts are enumerated once
    own = pool is None
    if not own:
        it = pool.imap(_cell, grid, chunksize=chunk)
    elif workers <= 1:
        it = map(_cell, grid)
        pool = None
    else:  # fork: the workers start with the cost model already imported
        pool = multiprocessing.get_context("fork").Pool(workers)
        it = pool.imap(_cell, grid, chunksize=chunk)
    try:
        for i, c in enumerate(it):
            cells.append(c)
            if progress:
                progress(i + 1, len(grid))
    finally:
        if own and pool is not None:
            pool.close()
            pool.join()
    return cells


def cell_text(c: Cell, band: ErrorBand | None = None) -> str:
    """Compact markdown cell: layout and knobs on one line, MFU and memory on the next. With
    ``band``: ``≈`` and the runner-up layout when its predicted speed is within the backtest's
    error (a tie), ``⚠`` after the memory when it is within the memory check's band of HBM."""
    if not c.fits:
        return "does not fit"
    tie = bool(band and c.runner_up and band.tie(c.tokens_per_s, c.runner_up_tps))
    risk = bool(band and c.hbm_gib and band.memory_risk(c.mem_gib, c.hbm_gib))
    knobs = [f"Z{c.zero}", f"mb{c.micro_batch}"]
    if c.virtual_stages > 1:
        knobs.append(f"v{c.virtual_stages}")
    if c.recompute != "none":
        knobs.append(RECOMPUTE_LABEL[c.recompute])
    text = f"{c.layout} {' '.join(knobs)}{' ≈' if tie else ''}<br>{c.mfu:.0%} · "
    text += f"{c.mem_gib:.0f} GiB{' ⚠' if risk else ''}"
    if tie:
        text += f"<br>≈ {c.runner_up} {1 - c.runner_up_tps / c.tokens_per_s:.1%} slower"
    return text
