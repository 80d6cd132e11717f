"""The micro-measurements of `make gpu-check`, one per process (`python -m dtrain.gpucheck.measure
NAME [--size N]`), each printing one JSON line: the machine, device-to-device copy bandwidth,
bf16 and FP8 GEMM throughput.

Timing: dtrain.model.timing.time_fn (CUDA events around each call after warmup calls, synchronized),
the median over the timed calls. A copy moves its bytes twice (read + write), so its bandwidth
counts
2 x bytes, as the ~3 TB/s figures quoted for H100 copies do. GEMM FLOPs = 2 n^3. On CPU the same
code runs at small sizes (tests); only GPU numbers go into a report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from dtrain.core.errors import UserError
from dtrain.costmodel import hardware
from dtrain.model.timing import time_fn
from dtrain.run import envinfo


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def env() -> dict:
    dev = device()
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": envinfo.nccl_version(),
        "python": sys.version.split()[0],
        "cpu_model": envinfo.cpu_model(),  # the host whose issue time a profile's floor is
        "cpu_count": os.cpu_count(),
        "device": str(dev),
        "gpus": envinfo.gpu_facts(),
    }
    if dev.type == "cuda":
        facts["gpu_name"] = torch.cuda.get_device_name(dev)
        facts["profile"] = hardware.gpu_profile_name(facts["gpu_name"])
    return facts


def copy_bandwidth(nbytes: int = 1 << 30, warmup: int = 3, iters: int = 20) -> dict:
    dev = device()
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    stats = time_fn(lambda: dst.copy_(src), warmup=warmup, iters=iters, device=dev)
    assert torch.equal(dst[:4096], src[:4096])
    return {
        "bytes": nbytes,
        "median_s": stats.median,
        "min_s": stats.min,
        "GBps_read_plus_write": 2 * nbytes / stats.median / 1e9,
        "iters": iters,
    }


def _peak(dtype: str) -> tuple[float | None, str | None]:
    try:
        return hardware.peak_flops(device(), dtype) if device().type == "cuda" else (None, None)
    except UserError as e:
        return None, str(e)


def gemm_bf16(n: int = 8192, warmup: int = 5, iters: int = 20) -> dict:
    dev = device()
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    stats = time_fn(lambda: torch.mm(a, b, out=out), warmup=warmup, iters=iters, device=dev)
    tflops = 2 * n**3 / stats.median / 1e12
    peak, source = _peak("bf16")
    return {
        "n": n,
        "median_s": stats.median,
        "tflops": tflops,
        "peak_tflops": peak and peak / 1e12,
        "share_of_peak": peak and tflops * 1e12 / peak,
        "peak_source": source,
    }


def gemm_fp8(n: int = 8192, warmup: int = 5, iters: int = 20) -> dict:
    """torch._scaled_mm: A (n x k) row-major E4M3, B (k x n) column-major E4M3 (the layout
    cuBLASLt's FP8 GEMM takes: a row-major (n x k) tensor, transposed), fp32 per-tensor scales,
    bf16 out."""
    dev = device()
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return {"n": n, "skipped": "no FP8 tensor cores (compute capability < 8.9)"}
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev, generator=g).to(torch.float8_e4m3fn).t()  # column-major view
    one = torch.ones((), device=dev, dtype=torch.float32)
    out = {}
    for fast in (False, True):

        def fn():
            return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)

        stats = time_fn(fn, warmup=warmup, iters=iters, device=dev)
        out["tflops_fast_accum" if fast else "tflops"] = 2 * n**3 / stats.median / 1e12
        out["median_s_fast_accum" if fast else "median_s"] = stats.median
    ref = (
        a[:64].float() @ b[:, :64].float()
    )  # a corner, against an fp32 matmul of the same FP8 values
    got = torch._scaled_mm(
        a[:64].contiguous(), b[:, :64], one, one, out_dtype=torch.bfloat16
    ).float()
    peak, source = _peak("fp8")
    return {
        "n": n,
        **out,
        "max_rel_err_vs_fp32": float((got - ref).abs().max() / ref.abs().max()),
        "peak_tflops": peak and peak / 1e12,
        "share_of_peak": peak and out["tflops_fast_accum"] * 1e12 / peak,
        "peak_source": source,
    }


MEASUREMENTS = {"env": env, "copy": copy_bandwidth, "gemm_bf16": gemm_bf16, "gemm_fp8": gemm_fp8}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.measure")
    p.add_argument("name", choices=sorted(MEASUREMENTS))
    p.add_argument("--size", type=int, default=None, help="bytes (copy) or n (gemm_*)")
    args = p.parse_args(argv)
    fn = MEASUREMENTS[args.name]
    kwargs = (
        {}
        if args.size is None
        else ({"nbytes": args.size} if args.name == "copy" else {"n": args.size})
    )
    print(json.dumps(fn(**kwargs)), flush=True)


if __name__ == "__main__":
    main()
