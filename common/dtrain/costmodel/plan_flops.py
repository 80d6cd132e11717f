"""One plan's FLOP rates per GPU, as `dtrain plan` prints them (text and JSON): model and executed
FLOPs against the dense and the measured GEMM peak."""

from __future__ import annotations

from .device_rates import device_of
from .search import SearchResult
from .token_flops import (
    EXECUTED_CONVENTION,
    FLOP_CONVENTION,
    executed_flops_per_token,
    model_flops_per_token,
)


def flops(res: SearchResult, p) -> dict:
    """One plan's FLOP rates per GPU: model FLOPs (``model_flops_per_token``, the MFU
    convention, ``FLOP_CONVENTION``) and the FLOPs its kernels execute
    (``executed_flops_per_token``: causal attention half, the recompute counted), against the
    GPU's dense peak and its measured GEMM peak (dense peak x e_max of the GEMM curve)."""
    t = p.time
    fp8 = res.precision == "fp8"
    gpu = res.cluster.gpu
    curves = device_of(res.cluster, res.calib, res.stack).kernels.gemm
    curve = (curves.get("fp8") if fp8 else None) or curves["bf16"]
    peak = gpu.peak_fp8_flops if fp8 and "fp8" in curves else gpu.peak_bf16_flops
    executed = executed_flops_per_token(res.model, p.recompute)
    per_gpu_s = t.total * t.gpus
    return {
        "flop_convention": FLOP_CONVENTION,
        "executed_convention": EXECUTED_CONVENTION,
        "model_flops_per_token": model_flops_per_token(res.model),
        "executed_flops_per_token": executed,
        "executed_tflops_per_gpu": executed * t.tokens / per_gpu_s / 1e12,
        "peak_tflops": peak / 1e12,
        "gemm_e_max": curve.e_max,
        "gemm_peak_tflops": peak * curve.e_max / 1e12,
    }
