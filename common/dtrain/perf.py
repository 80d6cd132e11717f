"""Peak FLOP/s and MFU: what a device could do, and what share of it a run achieved.

GPU peaks are datasheet dense tensor-core figures, read from the cost model's GPU table
(`dtrain/costmodel/hardware.yaml`, one source of truth), matched by CUDA device name.
CPUs have no datasheet figure we can trust (cores, AVX width and clocks vary), so on CPU the
peak is *measured*: a square fp32 matmul on this rank's threads. Every peak carries its source
("datasheet: h100-sxm bf16", "datasheet: h100-sxm tf32" or "measured cpu matmul probe") so results
say which one they used. fp32 training on a GPU runs its matmuls as TF32 (enable_tf32, recorded
in env.json as `matmul_tf32`), and its MFU is against the TF32 peak.

    MFU = achieved model FLOP/s per device / peak FLOP/s per device
        = flops_per_token * tokens_per_s / (world_size * peak_flops)
"""
from __future__ import annotations

import re
import time
from functools import lru_cache

import torch

from dtrain.errors import UserError

CPU_PROBE_SOURCE = "measured cpu matmul probe"

# Exact CUDA device names (torch.cuda.get_device_name, lower case, whole name) -> hardware.yaml
# profile. Whole-name matches on purpose: "H100 NVL" and "H100 PCIe" have lower peaks than the SXM
# part, so a name we do not know is an error, never the nearest guess.
GPU_NAMES = [
    (r"nvidia h100 80gb hbm3|nvidia h100 sxm5? ?(80gb)?", "h100-sxm"),
    (r"nvidia h100 pcie", "h100-pcie"),
    (r"nvidia h100 nvl", "h100-nvl"),
    (r"nvidia h200", "h200"),
    (r"nvidia a100-(sxm4|pcie)-40gb", "a100-40gb"),
    (r"nvidia a100-(sxm4|pcie)-80gb|nvidia a100 80gb pcie", "a100-80gb"),
    (r"nvidia b200", "b200"),
]
# matmul precision -> share of the dense bf16 tensor-core peak. TF32 runs at half the bf16 rate on
# A100, H100 (SXM, PCIe, NVL), H200 and B200 (their datasheets); plain fp32 (CUDA cores, TF32 off)
# has no tensor-core figure here, so fp32 training on a GPU turns TF32 on (enable_tf32).
_SHARE_OF_BF16 = {"bf16": 1.0, "fp16": 1.0, "tf32": 0.5}


def gpu_profile_name(device_name: str) -> str | None:
    """hardware.yaml profile for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm")."""
    name = " ".join(device_name.lower().split())
    for pattern, profile in GPU_NAMES:
        if re.fullmatch(pattern, name):
            return profile
    return None


def datasheet_peak(profile: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a known GPU for bf16 | fp16 | tf32 | fp8 (None: no such tensor cores)."""
    from dtrain.costmodel.hardware import get_profile

    p = get_profile(profile)
    if dtype == "fp8":
        return p.peak_fp8_flops
    share = _SHARE_OF_BF16.get(dtype)
    return None if share is None else p.peak_bf16_flops * share


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


def peak_flops(device: torch.device, dtype: str = "bf16") -> tuple[float, str]:
    """(peak FLOP/s per device, source). dtype: the matmul precision, bf16 | fp16 | fp8 | fp32; on a
    GPU fp32 means TF32 when it is on (enable_tf32) and is refused otherwise.

    An unknown GPU is a UserError naming hardware.yaml rather than an invented peak."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = gpu_profile_name(name)
        if profile is None:
            raise UserError(f"no datasheet peak for GPU {name!r}, so no MFU: add its profile to "
                            "dtrain/costmodel/hardware.yaml and its name to dtrain.perf.GPU_NAMES")
        if dtype == "fp32":
            dtype = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        peak = datasheet_peak(profile, dtype)
        if peak is None:
            raise UserError(f"{profile} has no {dtype} tensor-core peak in dtrain/costmodel/hardware.yaml "
                            "(fp8: Ada/Hopper and newer; fp32: turn TF32 on)")
        return peak, f"datasheet: {profile} {dtype}"
    return cpu_matmul_probe(), CPU_PROBE_SOURCE


def mfu(flops_per_token: float, tokens_per_s: float, world_size: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per device over its peak."""
    return flops_per_token * tokens_per_s / world_size / peak_flops_per_device


def tflops_per_device(flops_per_token: float, tokens_per_s: float, world_size: int) -> float:
    return flops_per_token * tokens_per_s / world_size / 1e12
