"""What a training run reports: each step's metrics (records.jsonl; TensorBoard's `train/<name>`
for `SCALARS`), the run-level numbers, the peak FLOP/s its MFU is taken against, and the check that
the run ended on a finite loss."""

from __future__ import annotations

import resource
import statistics

import torch
import torch.distributed as dist

from dtrain.costmodel import hardware
from dtrain.model import perf
from dtrain.results.metrics import finite_or_none

# the per-step numbers shown in TensorBoard too, as `train/<name>` (records.jsonl holds them all)
SCALARS = (
    "loss",
    "step_time_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_bytes",
    "grad_norm",
    "lr",
)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's peak RSS on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class NonFiniteLoss(RuntimeError):
    """Training ended on a NaN/Inf loss: the run failed (never `complete`, nothing calibrates
    from it)."""


def require_finite_end(last: dict) -> None:
    """A run is complete only when its last step's loss is finite (records store NaN/Inf as
    null)."""
    if last and last.get("loss") is None:
        raise NonFiniteLoss(
            f"the loss is non-finite at the last step ({last.get('step')}): the run diverged; "
            "lower train.lr, set train.grad_clip, or check the data and model.init_std"
        )


def agreed_peak_flops(device: torch.device, precision: str, world_size: int) -> tuple[float, str]:
    """The peak FLOP/s and its source that MFU is taken against (`hardware.peak_flops`)."""
    peak, source = hardware.peak_flops(device, "fp32" if precision == "fp32" else "bf16")
    if (
        source == perf.CPU_PROBE_SOURCE
    ):  # every rank probed its own cores at once; agree on the mean
        peak = _all_mean(peak, world_size, device)
    return peak, source


def _all_mean(value: float, world_size: int, device: torch.device) -> float:
    if world_size == 1 or not dist.is_initialized():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world_size


def step_metrics(trainer, step, loss, grad_norm, lr, step_time, took) -> dict:
    """One optimizer step's record (`took`: its optimizer step was taken)."""
    warmup = step <= trainer.train.timing_warmup
    tokens_per_s = trainer.tokens_per_step / step_time
    m = {
        "step": step,
        "loss": finite_or_none(loss),
        "grad_norm": finite_or_none(grad_norm),
        "lr": lr,
        "lr_scale": trainer.lr_scale,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "tflops": perf.tflops_per_device(trainer.flops_per_token, tokens_per_s, trainer.world_size),
        "mfu": perf.mfu(
            trainer.flops_per_token, tokens_per_s, trainer.world_size, trainer.peak_flops
        ),
        "peak_mem_bytes": peak_memory_bytes(trainer.device),
        "warmup_step": warmup,
        "skipped": not took,
    }
    if trainer.grad_scaler is not None:
        m["grad_scale"] = float(trainer.grad_scaler.get_scale())
    return m


def final_metrics(trainer, last: dict | None = None) -> dict:
    """Run-level numbers: step time is the median over steps after timing_warmup."""
    times = trainer.step_times or ([last["step_time_s"]] if last else [])
    step_time = statistics.median(times) if times else float("nan")
    tokens_per_s = trainer.tokens_per_step / step_time
    return {
        "steps": trainer.step,
        "final_loss": (last or {}).get("loss"),
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "tokens_per_step": trainer.tokens_per_step,
        "tflops_per_rank": perf.tflops_per_device(
            trainer.flops_per_token, tokens_per_s, trainer.world_size
        ),
        "mfu": perf.mfu(
            trainer.flops_per_token, tokens_per_s, trainer.world_size, trainer.peak_flops
        ),
        "peak_flops": trainer.peak_flops,
        "peak_flops_source": trainer.peak_flops_source,
        "flops_per_token": trainer.flops_per_token,
        "model_params": trainer.model_params,
        "peak_mem_bytes": peak_memory_bytes(trainer.device),
        "global_batch": trainer.batcher.global_batch,
        "grad_accum": trainer.train.grad_accum,
        "strategy": trainer.train.strategy,
        "tp": trainer.dims.tp,
        "pp": trainer.dims.pp,
        "dp": trainer.dims.dp,
        "cp": trainer.dims.cp,
        "cp_impl": trainer.parallel.cp_impl,
        "ep": trainer.dims.ep,
        **(trainer.moe_metrics.summary() if trainer.moe_metrics else {}),
        "pp_schedule": trainer.train.pp_schedule if trainer.dims.pp > 1 else None,
        "mixed_precision": trainer.train.precision,
        "matmul_tf32": trainer.tf32,
        "world_size": trainer.world_size,
        "last_checkpoint": trainer.last_checkpoint,
    }
