"""The head of `dtrain plan`'s report: the model, the cluster (its links and power cap), the batch
and what calibrated the model, each as one line of text."""

from __future__ import annotations

from .kernel_rates import published
from .hardware import Cluster
from .search import SearchResult
from .shapes import ModelShape, params_text


def calibration_notes(report) -> list[str]:
    gpu = [c for c in report.candidates if c.source.on_gpu]
    cpu = [c for c in report.candidates if not c.source.on_gpu]
    notes = [
        f"calibration: {len(report.runs)} complete run(s); {len(gpu)} value(s) measured on CUDA "
        "used"
    ]
    if cpu:
        notes.append(
            f"  {len(cpu)} value(s) measured on CPU ignored: a CPU/gloo run does not describe a "
            "GPU cluster"
        )
    if not gpu:
        notes.append("  no GPU measurements: datasheet/published values are used")
    return notes


def describe_cluster(c: Cluster) -> str:
    """The links as the model uses them: the bus bandwidth collectives reach (datasheet rate x
    link efficiency, or allreduce-bench's measurement)."""
    return (
        f"{c.gpus} x {c.gpu.name}, {c.gpus_per_node} per node; intra-node {c.nvlink.name} "
        f"{c.nvlink.beta_Bps / 1e9:.4g} GB/s per direction achieved, inter-node "
        f"{c.ib.beta_Bps / 1e9:.4g} GB/s per GPU achieved ({c.ib.beta_Bps * 8 / 1e9:.4g} Gbit/s)"
    )


def describe_power(c: Cluster) -> str | None:
    """The power-cap term, when the cluster's GPUs run below the board power their kernel rates
    were measured at (``--power-w``); None otherwise."""
    table = published(c.gpu.name)
    scale = table.power_scale(c.gpu.power_w) if table else 1.0
    if scale == 1.0:
        return None
    return (
        f"{c.gpu.power_w:g} W cap of the {table.power_w:g} W the kernel rates were measured at: "
        f"tensor-core work x{scale:.3f} the time (the clock's cube root of the power above the "
        f"{table.idle_w:g} W idle draw; kernels.yaml)"
    )


def describe_model(s: ModelShape) -> str:
    return (
        f"{s.name or 'custom'}: {s.n_layer} layers, d_model {s.d_model}, {s.n_head} heads "
        f"({s.n_kv_head} KV), seq {s.seq_len}, {params_size(s.num_params())} params"
    )


def params_size(n: int) -> str:
    """Billions to one decimal (6.7B, 405.9B), as the plan always printed them; below 1B: 29M."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else params_text(n)


def batch_text(res: SearchResult) -> str:
    tokens = res.global_batch * res.model.seq_len
    return (
        f"{tokens / 1e6:.2f}M tokens/step = {res.global_batch} sequences x {res.model.seq_len} "
        "tokens"
    )
