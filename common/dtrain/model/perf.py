"""MFU, TF32 and the CPU matmul probe: what share of a device's peak a run achieved.

The peak itself comes from `dtrain.costmodel.hardware.peak_flops`: on a GPU the datasheet dense
tensor-core figure of the cost model's GPU table (`hardware.yaml`, one source of truth); on a CPU,
which has no datasheet figure we can trust (cores, AVX width and clocks vary), `cpu_matmul_probe`
here: a square fp32 matmul on this rank's threads. fp32 training on a GPU runs its matmuls as TF32
(enable_tf32, recorded in the run's summary as `matmul_tf32`), and its MFU is against the TF32 peak.

    MFU = achieved model FLOP/s per device / peak FLOP/s per device
        = flops_per_token * tokens_per_s / (world_size * peak_flops)
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch

CPU_PROBE_SOURCE = "measured cpu matmul probe"


def enable_tf32(device: torch.device) -> bool:
    """Let fp32 matmuls and convolutions on a GPU run as TF32 on tensor cores (PyTorch's default is
    full fp32 for matmuls). True when it applies, i.e. on CUDA; record it where the run says so."""
    if torch.device(device).type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


@lru_cache(maxsize=4)
def cpu_matmul_probe(n: int = 512, iters: int = 8, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n x n matmul on this process's torch threads (best of `iters`).

    The best rather than the median: the peak is what the cores can do; noise from other
    processes only ever makes a sample slower."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def mfu(
    flops_per_token: float, tokens_per_s: float, world_size: int, peak_flops_per_device: float
) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per device over its peak."""
    return flops_per_token * tokens_per_s / world_size / peak_flops_per_device


def tflops_per_device(flops_per_token: float, tokens_per_s: float, world_size: int) -> float:
    return flops_per_token * tokens_per_s / world_size / 1e12
