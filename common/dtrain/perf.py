"""Peak FLOP/s and MFU: what a device could do, and what share of it a run achieved.

GPU peaks are datasheet dense tensor-core figures, read from the cost model's GPU table
(`dtrain/costmodel/hardware.yaml`, one source of truth), matched by CUDA device name.
CPUs have no datasheet figure we can trust (cores, AVX width and clocks vary), so on CPU the
peak is *measured*: a square fp32 matmul on this rank's threads. Every peak carries its source
("datasheet: h100-sxm" or "measured cpu matmul probe") so results say which one they used.

    MFU = achieved model FLOP/s per device / peak FLOP/s per device
        = flops_per_token * tokens_per_s / (world_size * peak_flops)
"""
from __future__ import annotations

import time
from functools import lru_cache

import torch

CPU_PROBE_SOURCE = "measured cpu matmul probe"

# CUDA device-name fragments (lower case) -> hardware.yaml profile; first match wins, so the
# more specific names come first.
_GPU_NAMES = [("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h200", "h200"), ("gh200", "h200"),
              ("b200", "b200"), ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"),
              ("a100", "a100-80gb")]


def gpu_profile_name(device_name: str) -> str | None:
    """hardware.yaml profile for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm")."""
    name = device_name.lower()
    for fragment, profile in _GPU_NAMES:
        if fragment in name:
            return profile
    return None


def datasheet_peak(profile: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a known GPU for bf16 or fp8 (None when it has no such tensor cores)."""
    from dtrain.costmodel.hardware import get_profile

    p = get_profile(profile)
    if dtype == "fp8":
        return p.peak_fp8_flops
    if dtype in ("bf16", "fp16"):
        return p.peak_bf16_flops
    # fp32 matmuls run as TF32 on tensor cores at half the bf16 rate (A100/H100/B200 datasheets)
    return p.peak_bf16_flops / 2


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


def peak_flops(device: torch.device, dtype: str = "bf16") -> tuple[float, str]:
    """(peak FLOP/s per device, source). dtype: fp32 | bf16 | fp16 | fp8 (the compute precision).

    An unknown GPU raises ValueError naming what to add to hardware.yaml rather than invent a peak."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = gpu_profile_name(name)
        if profile is None:
            raise ValueError(f"no datasheet peak for GPU {name!r}: add it to dtrain/costmodel/hardware.yaml "
                             "and dtrain.perf._GPU_NAMES")
        peak = datasheet_peak(profile, dtype)
        if peak is None:
            raise ValueError(f"{profile} has no {dtype} tensor cores (datasheet)")
        return peak, f"datasheet: {profile}"
    return cpu_matmul_probe(), CPU_PROBE_SOURCE


def mfu(flops_per_token: float, tokens_per_s: float, world_size: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per device over its peak."""
    return flops_per_token * tokens_per_s / world_size / peak_flops_per_device


def tflops_per_device(flops_per_token: float, tokens_per_s: float, world_size: int) -> float:
    return flops_per_token * tokens_per_s / world_size / 1e12
