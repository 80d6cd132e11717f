"""Kernel sweeps of `make gpu-check`: the per-GPU numbers the cost model's compute terms are built
from (GEMM efficiency by shape and dtype, fused attention throughput by head dim and sequence
length, memory-bound kernels against HBM bandwidth). One process each, one JSON line out:

    python -m dtrain.gpucheck.kernels gemm_sweep | attention_sweep | membound [--small]

(training steps under the profiler: `dtrain.gpucheck.stepprof`)

`--small` runs the same code at CPU-sized shapes (the tests); only GPU numbers go into a report.

Timing: `dtrain.model.timing.queued_s`, CUDA events around R back-to-back calls (R chosen so a
timing lasts ~5 ms), the median of 3 such timings over R: the time a kernel costs inside a training
step, where the CPU has
already queued the next one. (Timing each call alone adds the launch gap, ~10-30 us, which made the
small shapes of the first H100 check, measured that way, look 2-5x slower.)

Conventions (those of the published kernel benchmarks, so the numbers compare):
- GEMM FLOPs = 2·m·n·k; random normal inputs (zeros run faster on Hopper and are not training).
  FP8 is torch._scaled_mm, E4M3 x E4M3 -> bf16 with per-tensor fp32 scales, with and without
  fast accumulation (torchao's float8 training uses fast accumulation in the forward GEMM only).
- Attention FLOPs (FlashAttention's benchmark): forward 4·b·h·s²·d, halved when causal; backward
  2.5x the forward (five matmuls against two); fwd+bwd = 3.5x.
- Memory-bound kernels: bytes = what the op must read and write once (inputs, outputs, saved
  tensors; fp32 optimizer states), over the median time, against the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from dtrain.model.timing import queued_s

from .devices import _device, _name
from .membound import membound


def gemm_sweep(small: bool = False) -> dict:
    """bf16 (and FP8 where the GPU has it) TFLOP/s over the GEMM shapes LLM training runs: m =
    tokens of a micro-batch, n and k from the model's hidden and FFN widths (TP shards included)."""
    dev = _device()
    dims = (32, 64, 256) if small else (512, 1024, 2048, 4096, 8192, 16384, 32768)
    ms = nks = dims
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fp8 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
    g = torch.Generator(device=dev).manual_seed(0)
    one = torch.ones((), device=dev, dtype=torch.float32)
    points = []
    for m in ms:
        for n in nks:
            for k in nks:
                if (
                    2 * m * n * k > 2**45
                ):  # > 35 TFLOP: as efficient as the next size down, and slow to time
                    continue
                a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
                b = torch.randn(k, n, device=dev, dtype=dtype, generator=g)
                flops = 2 * m * n * k
                row = {
                    "m": m,
                    "n": n,
                    "k": k,
                    "flops": flops,
                    "bf16_tflops": flops / queued_s(lambda: a @ b, dev) / 1e12,
                }
                if fp8:
                    a8 = a.to(torch.float8_e4m3fn)
                    b8 = (
                        b.t().contiguous().to(torch.float8_e4m3fn).t()
                    )  # column-major, as cuBLASLt takes B
                    for fast in (False, True):
                        s = queued_s(
                            lambda: torch._scaled_mm(
                                a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast
                            ),
                            dev,
                        )
                        row["fp8_fast_tflops" if fast else "fp8_tflops"] = flops / s / 1e12
                points.append(row)
                a = b = None  # frees them (a del hides them from the closures)
    return {"device": _name(dev), "dtype": str(dtype).replace("torch.", ""), "points": points}


ATTN_BACKENDS = ("flash", "cudnn", "default")


def _backend_ctx(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return (
        nullcontext()
        if name == "default"
        else sdpa_kernel(
            {
                "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[name]
        )
    )


def attention_sweep(small: bool = False) -> dict:
    """SDPA forward and forward+backward TFLOP/s, bf16, per backend, FlashAttention's benchmark
    grid:
    total tokens b·s fixed (16K), hidden 2048 = heads x head_dim, causal and not; hd 128 causal
    again with dropout_p 0.1 (what attention dropout costs inside the fused kernel: kernels.yaml
    ``dropout``)."""
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokens, hidden = (256, 64) if small else (16384, 2048)
    seqs = (64, 128) if small else (512, 1024, 2048, 4096, 8192, 16384, 32768)
    backends = ("math",) if dev.type != "cuda" else ATTN_BACKENDS
    points = []
    for head_dim, kv_div in ((32, 1),) if small else ((64, 1), (128, 1), (128, 8)):
        h = hidden // head_dim
        for s in seqs:
            b = max(1, tokens // s)
            q = torch.randn(b, h, s, head_dim, device=dev, dtype=dtype, requires_grad=True)
            k, v = (
                torch.randn(
                    b, h // kv_div, s, head_dim, device=dev, dtype=dtype, requires_grad=True
                )
                for _ in range(2)
            )
            dout = torch.randn(b, h, s, head_dim, device=dev, dtype=dtype)
            # GPT-3-style attention dropout inside the fused kernel (Megatron's default 0.1):
            # causal, hd 128 only
            drop = (0.1,) if small or (head_dim == 128 and kv_div == 1) else ()
            for causal, dropout_p in ((True, 0.0), (False, 0.0), *((True, p) for p in drop)):
                fwd_flops = 4 * b * h * s * s * head_dim / (2 if causal else 1)
                for backend in backends:
                    row = {
                        "backend": backend,
                        "head_dim": head_dim,
                        "heads": h,
                        "kv_heads": h // kv_div,
                        "batch": b,
                        "seq": s,
                        "causal": causal,
                        "dropout_p": dropout_p,
                        "fwd_flops": fwd_flops,
                    }
                    try:
                        with _backend_ctx(backend):
                            fwd = lambda: F.scaled_dot_product_attention(  # noqa: E731
                                q,
                                k,
                                v,
                                is_causal=causal,
                                dropout_p=dropout_p,
                                enable_gqa=kv_div > 1,
                            )

                            def fwd_bwd():
                                out = fwd()
                                torch.autograd.grad(out, (q, k, v), dout)

                            tf = queued_s(fwd, dev)
                            tfb = queued_s(fwd_bwd, dev)
                        row |= {
                            "fwd_tflops": fwd_flops / tf / 1e12,
                            "fwd_bwd_tflops": 3.5 * fwd_flops / tfb / 1e12,
                            "fwd_s": tf,
                            "fwd_bwd_s": tfb,
                        }
                    except RuntimeError as e:  # a backend that does not take this shape or GPU
                        row["error"] = str(e).splitlines()[0][:160]
                    points.append(row)
            q = k = v = dout = None  # frees them (a del hides them from the closures)
    return {
        "device": _name(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "tokens": tokens,
        "hidden": hidden,
        "points": points,
        "eager": eager_attention(small),
    }


def eager_attention(small: bool = False) -> list[dict]:
    """Attention without a fused kernel, as Megatron-LM ran it before FlashAttention: batched
    QK^T, a causal softmax over the stored s x s scores (one read, one write, 16-bit), batched
    AV; forward and forward+backward seconds and the time of each part, same grid as
    attention_sweep (hd 128)."""
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokens, hidden, hd = (256, 64, 32) if small else (16384, 2048, 128)
    h = hidden // hd
    out = []
    for s in (64, 128) if small else (512, 1024, 2048, 4096, 8192):
        b = max(1, tokens // s)
        q, k, v = (
            torch.randn(b * h, s, hd, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        mask = torch.ones(s, s, device=dev, dtype=torch.bool).triu(1)
        scores = torch.randn(b * h, s, s, device=dev, dtype=dtype, requires_grad=True)
        dout = torch.randn(b * h, s, hd, device=dev, dtype=dtype)

        def fwd():
            return torch.bmm(
                torch.softmax(
                    torch.bmm(q, k.transpose(1, 2)).masked_fill_(mask, float("-inf")), -1
                ),
                v,
            )

        row = {
            "seq": s,
            "batch": b,
            "heads": h,
            "head_dim": hd,
            "score_elements": b * h * s * s,
            "bmm_qk_s": queued_s(lambda: torch.bmm(q.detach(), k.detach().transpose(1, 2)), dev),
            "softmax_fwd_bwd_s": queued_s(
                lambda: torch.autograd.grad(torch.softmax(scores, -1), scores, scores.detach()), dev
            ),
            "fwd_s": queued_s(fwd, dev),
            "fwd_bwd_s": queued_s(lambda: torch.autograd.grad(fwd(), (q, k, v), dout), dev),
        }
        out.append(row)
        q = k = v = scores = dout = mask = None  # frees them (a del hides them from the closures)
    return out


# Kernel name -> category of the cost model's compute terms (first match wins; names of
# cuBLAS/CUTLASS, FlashAttention/cuDNN, PyTorch's elementwise/reduction and optimizer kernels).
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    (
        "gemm",
        ("gemm", "sm90_xmma", "sm80_xmma", "cutlass", "ampere_", "hopper_", "nvjet", "splitk"),
    ),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "softmax")),
    ("memcpy", ("memcpy", "memset")),
)


def _category(name: str) -> str:
    low = name.lower()
    return next(
        (cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "elementwise"
    )


def gpu_time_by_category(events) -> tuple[dict[str, float], dict[str, int]]:
    """GPU seconds and kernel launches per category from the profiler's per-name averages (their
    CUDA rows). The launch count is what eager dispatch pays for per step: a small model's step
    can be set by it rather than by the GPU (``kernels`` x the membound step's
    ``tiny_kernel_s``)."""
    seconds: dict[str, float] = {}
    launches: dict[str, int] = {}
    for ev in events:
        t = getattr(ev, "device_time_total", 0.0)
        # a GPU user annotation (a record_function scope on the GPU timeline) spans kernels
        # counted on their own rows: summing it too double-counts them
        if t and ev.device_type.name == "CUDA" and not getattr(ev, "is_user_annotation", False):
            cat = _category(ev.key)
            seconds[cat] = seconds.get(cat, 0.0) + t / 1e6
            launches[cat] = launches.get(cat, 0) + int(ev.count)
    return seconds, launches


SWEEPS = {
    "gemm_sweep": gemm_sweep,
    "attention_sweep": attention_sweep,
    "membound": membound,
}


def sweep_main(prog: str, sweeps: dict, argv: list[str] | None = None) -> None:
    """The command line of a module of sweeps: run the one named, print its JSON line."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("name", choices=sorted(sweeps))
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (tests)")
    args = p.parse_args(argv)
    print(json.dumps(sweeps[args.name](small=args.small)), flush=True)


def main(argv: list[str] | None = None) -> None:
    sweep_main("python -m dtrain.gpucheck.kernels", SWEEPS, argv)


if __name__ == "__main__":
    main()
