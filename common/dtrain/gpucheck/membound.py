"""`make gpu-check`'s membound sweep: achieved GB/s of the memory-bound kernels a transformer
step runs (norms, activations, residual adds, dropout, torchao's eager FP8 cast, the FP8 transpose,
cross-entropy, AdamW), at LLM widths, against a plain copy of the same bytes; some of them again
from a cold L2. Run by ``python -m dtrain.gpucheck.kernels membound [--small]`` (timing and
conventions: ``dtrain.gpucheck.kernels``); read by ``costmodel/kernels.yaml``'s memory shares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.model.timing import queued_s

from .devices import _device, _name
from .eager_bytes import EAGER_FP8_CAST_BYTES, eager_fp8_cast


def l2_flush(dev: torch.device):
    """A write over a buffer four times the GPU's L2 (at least 256 MiB; 1 MiB off CUDA): after it
    none of an op's inputs is in L2."""
    size = 1 << 20
    if dev.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        size = max(256 << 20, 4 * l2)
    buf = torch.empty(size // 4, dtype=torch.int32, device=dev)
    return buf.zero_


def cold_s(fn, dev: torch.device, flush) -> float:
    """Seconds per call of ``fn`` with its inputs out of L2: (flush, call) pairs back to back less
    the flush alone (``queued_s`` each). membound's other rows repeat an op on the same tensors,
    whose tail stays in L2 between calls (50 MB on an H100; 16K tokens x 2048 in bf16: 64 MiB)."""
    both = queued_s(lambda: (flush(), fn()), dev)
    return max(both - queued_s(flush, dev), 1e-9)


# the ops membound also times from a cold L2 (``cold_s``), as "<op>_l2cold" rows
COLD_OPS = ("copy", "residual_add", "layer_norm_fwd_bwd", "fp8_cast_eager_bf16")


def membound(small: bool = False) -> dict:
    """Achieved GB/s of the memory-bound kernels a transformer step runs, at LLM widths, bf16 (fp32
    for the optimizer), against a plain copy of the same bytes; ``COLD_OPS`` again from a cold
    L2 (a step's elementwise kernels run ~7-25% slower than these rows price them:
    `dtrain backtest --measured`, term by term)."""
    dev = _device()
    flush = l2_flush(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    vb = torch.tensor([], dtype=dtype).element_size()
    tokens = 512 if small else 16384
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def add(name: str, nbytes: float, fn, **facts):
        for op, s in ((name, queued_s(fn, dev)),) + (
            ((f"{name}_l2cold", cold_s(fn, dev, flush)),) if name in COLD_OPS else ()
        ):
            rate = nbytes / s / 1e9
            rows.append({"op": op, "bytes": nbytes, "seconds": s, "GBps": rate, **facts})

    for d in (64,) if small else (768, 2048, 4096, 8192):
        x = torch.randn(tokens, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
        w = torch.ones(d, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, d, device=dev, dtype=dtype, generator=g)
        n = tokens * d * vb
        add("copy", 2 * n, lambda: x.detach().clone(), d=d)
        add("rms_norm_fwd", 2 * n, lambda: F.rms_norm(x.detach(), (d,), w.detach()), d=d)
        # backward reads x, dy and writes dx (weight grad is a reduction): 3 passes, plus the
        # forward's 2
        add(
            "rms_norm_fwd_bwd",
            5 * n,
            lambda: torch.autograd.grad(F.rms_norm(x, (d,), w), (x, w), dy),
            d=d,
        )
        add(
            "layer_norm_fwd_bwd",
            5 * n,
            lambda: torch.autograd.grad(F.layer_norm(x, (d,), w), (x, w), dy),
            d=d,
        )
        wide = 4 * d if not small else 2 * d
        a = torch.randn(tokens, wide, device=dev, dtype=dtype, generator=g, requires_grad=True)
        b = torch.randn_like(a, requires_grad=True)
        dh = torch.randn_like(a)
        na = a.numel() * vb
        # SwiGLU's elementwise part: fwd reads a, b writes h (3); bwd reads a, b, dh writes da, db
        # (5)
        add("swiglu_fwd_bwd", 8 * na, lambda: torch.autograd.grad(F.silu(a) * b, (a, b), dh), d=d)
        add("residual_add", 3 * n, lambda: x.detach() + dy, d=d)
        # GELU (MLP width 4d): fwd reads a writes h (2), bwd reads a, dh writes da (3)
        add(
            "gelu_fwd_bwd",
            5 * na,
            lambda: torch.autograd.grad(F.gelu(a, approximate="tanh"), a, dh),
            d=d,
        )
        add("dropout_fwd", 2 * n + tokens * d, lambda: F.dropout(x.detach(), 0.1, True), d=d)
        # a linear's input under autocast is fp32 (the norm's output), its output gradient bf16
        casts = (("fp8_cast_eager_fp32", torch.float32), ("fp8_cast_eager_bf16", torch.bfloat16))
        for name, cast_dtype in casts:
            src = x.detach().to(cast_dtype)
            cast = eager_fp8_cast(src)
            if cast is not None:  # torchao's cast, unfused, at EAGER_FP8_CAST_BYTES per element
                add(name, EAGER_FP8_CAST_BYTES * src.numel(), cast, d=d)
        # the transposed FP8 copy a column-major _scaled_mm operand needs (read 1, write 1 byte)
        f8 = x.detach().to(torch.float8_e4m3fn)
        add("fp8_transpose", 2 * f8.numel(), lambda: f8.t().contiguous(), d=d)
        x = w = dy = a = b = dh = f8 = None  # frees them (a del hides them from the closures)
    for vocab in (128,) if small else (32768, 128256):
        logits = torch.randn(
            tokens // 4, vocab, device=dev, dtype=dtype, generator=g, requires_grad=True
        )
        tgt = torch.randint(0, vocab, (tokens // 4,), device=dev, generator=g)
        n = logits.numel() * vb
        # fp32 upcast of bf16 logits, log-softmax and its gradient: read logits twice, write dlogits
        # once
        add(
            "cross_entropy_fwd_bwd",
            3 * n,
            lambda: torch.autograd.grad(F.cross_entropy(logits.float(), tgt), logits),
            vocab=vocab,
        )
        logits = None  # frees them (a del hides them from the closures)
    numel = 1 << 16 if small else 1 << 27  # 134M fp32 parameters
    p = torch.zeros(numel, device=dev, requires_grad=True)
    p.grad = torch.randn(numel, device=dev, generator=g)
    for fused in (False,) if dev.type != "cuda" else (False, True):
        opt = torch.optim.AdamW([p], lr=1e-4, fused=fused, foreach=None if fused else True)
        opt.step()
        # AdamW reads param, grad, m, v and writes param, m, v: 7 x 4 bytes per parameter
        add("adamw_fused" if fused else "adamw_foreach", 7 * 4 * numel, opt.step, params=numel)
    launch = queued_s(
        lambda: torch.add(p[:1], 1.0), dev
    )  # eager dispatch per op: the CPU-bound floor
    return {
        "device": _name(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "tokens": tokens,
        "ops": rows,
        "tiny_kernel_s": launch,
    }
