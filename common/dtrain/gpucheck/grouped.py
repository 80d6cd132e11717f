"""Grouped GEMM of an MoE layer's experts against the dense GEMM of the same FLOPs, by tokens per
expert: why expert parallelism pays (more tokens per local expert) and where it stops paying.

    python -m dtrain.gpucheck.grouped [--small]

The shape is a Qwen3-30B-A3B-like expert (hidden 2048, expert FFN 768; gate and up fused, so the
first GEMM is 2048 -> 1536) with 16 local experts (128 experts over EP 8). Per point, m tokens per
expert: ``torch._grouped_mm`` (one launch for all experts, the weights stored (E, N, K) and passed
transposed as torchtitan does), a per-expert loop of ``mm`` (what a model without grouped GEMM
runs), one dense GEMM over all E·m rows against one expert's weight (the same FLOPs in one
cuBLAS call: the ceiling), and on Hopper FP8 ``torch._scaled_grouped_mm`` with row-wise scales.
TFLOP/s = 2·E·m·K·N / time (``dtrain.model.timing.queued_s``).
"""

from __future__ import annotations

import argparse
import json

import torch

from dtrain.gpucheck.kernels import _device, _name
from dtrain.model.timing import queued_s

HIDDEN, EXPERT_FFN, LOCAL_EXPERTS = 2048, 768, 16
TOKENS_PER_EXPERT = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (sum m_e, K) rows sorted by expert, w (E, N, K), offs the cumulative row ends (int32)."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def loop_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The reference: one ``mm`` per expert over its rows."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[e].t())
        start = end
    return torch.cat(out)


def _fp8_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values and the fp32 reciprocal scale per row of the last dim (what torchao's rowwise
    recipe passes to the scaled GEMMs)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = torch.finfo(torch.float8_e4m3fn).max / amax
    return (t.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).squeeze(-1)


def sweep(small: bool = False) -> dict:
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    experts, k, n = (4, 64, 96) if small else (LOCAL_EXPERTS, HIDDEN, 2 * EXPERT_FFN)
    ms = (16, 32) if small else TOKENS_PER_EXPERT
    hopper = dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(experts, n, k, device=dev, dtype=dtype, generator=g) / k**0.5
    points = []
    for m in ms:
        x = torch.randn(experts * m, k, device=dev, dtype=dtype, generator=g)
        offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * m
        flops = 2 * experts * m * k * n
        ref = loop_mm(x, w, offs)
        err = (grouped_mm(x, w, offs).float() - ref.float()).abs().max().item()
        row = {
            "tokens_per_expert": m,
            "experts": experts,
            "k": k,
            "n": n,
            "flops": flops,
            "grouped_vs_loop_max_abs_err": err,
            "grouped_tflops": flops / queued_s(lambda: grouped_mm(x, w, offs), dev) / 1e12,
            "loop_tflops": flops / queued_s(lambda: loop_mm(x, w, offs), dev) / 1e12,
            "dense_tflops": flops / queued_s(lambda: x @ w[0].t(), dev) / 1e12,
        }
        if hopper:
            try:
                x8, sx = _fp8_rowwise(x)
                w8, sw = _fp8_rowwise(w)
                w8t = w8.transpose(-2, -1)

                def fp8():
                    return torch._scaled_grouped_mm(
                        x8, w8t, sx, sw, offs=offs, out_dtype=torch.bfloat16
                    )

                got = fp8().float()
                row["fp8_rel_err"] = ((got - ref.float()).norm() / ref.float().norm()).item()
                row["fp8_grouped_tflops"] = flops / queued_s(fp8, dev) / 1e12
            except Exception as e:  # noqa: BLE001 - an unsupported kernel is a result
                row["fp8_error"] = f"{type(e).__name__}: {e}"[:200]
        points.append(row)
        x = None
    return {"device": _name(dev), "dtype": str(dtype).replace("torch.", ""), "points": points}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.grouped")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (tests)")
    args = p.parse_args(argv)
    print(json.dumps(sweep(small=args.small)), flush=True)


if __name__ == "__main__":
    main()
