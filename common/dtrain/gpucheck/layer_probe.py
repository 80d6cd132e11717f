"""The layer probe of `make gpu-check` (`python -m dtrain.gpucheck.probes layer_probe`): one
transformer block of a published model at the shard one GPU of its layout runs (Llama 3.1 405B at
TP8: 16 of 128 query heads, 1 of 8 KV heads, 6656 of 53248 FFN columns; Llama 3.1 8B whole), the
way torchtitan runs it: RMSNorm, RoPE, K/V repeated to the query heads, SDPA's flash backend,
SwiGLU, full activation checkpointing, torch.compile, bf16 or torchao's tensorwise float8.
Forward+backward timed, and its GPU time by kernel category (profiler). The cost model prices the
same block on the same GPU with `dtrain plan --layers 1 ...` (the `plan_command` each case prints),
so measured / predicted is one number per case. Without sequence parallelism the norms run on every
token, as the model is asked to price them. `small=True` runs it at CPU sizes in fp32 without
compile (the tests).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.costmodel.hardware import gpu_profile_name
from dtrain.gpucheck.kernels import _device, _name, gpu_time_by_category
from dtrain.model.gpt import causal_attention
from dtrain.model.timing import time_fn

# name: (d_model, heads, kv_heads, ffn_hidden, tp, micro_batch, seq, vocab) of the published models
LAYER_CASES = {
    "llama3_405b_tp8": (16384, 128, 8, 53248, 8, 2, 8192, 128256),
    "llama3_8b": (4096, 32, 8, 14336, 1, 1, 8192, 128256),
}
SMALL_CASE = {"tiny_tp2": (256, 8, 4, 512, 2, 1, 64, 1024)}


class ShardBlock(nn.Module):
    """One Llama block as one TP rank holds it (column-parallel wq/wk/wv/w1/w3, row-parallel
    wo/w2)."""

    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, tp: int):
        super().__init__()
        self.hd, self.heads, self.kv = d // heads, max(heads // tp, 1), max(kv_heads // tp, 1)
        self.wq = nn.Linear(d, self.heads * self.hd, bias=False)
        self.wk = nn.Linear(d, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(d, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(self.heads * self.hd, d, bias=False)
        self.w1 = nn.Linear(d, ffn // tp, bias=False)
        self.w3 = nn.Linear(d, ffn // tp, bias=False)
        self.w2 = nn.Linear(ffn // tp, d, bias=False)
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.n1(x)
        q = _rope(self.wq(h).view(b, s, self.heads, self.hd), cos, sin).view(b, s, -1)
        k = _rope(self.wk(h).view(b, s, self.kv, self.hd), cos, sin).view(b, s, -1)
        # dtrain's attention core: K and V repeated to the query heads before SDPA, as torchtitan's
        # model does
        x = x + self.wo(causal_attention(q, k, self.wv(h), self.hd))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def layer_flops(d: int, heads: int, kv_heads: int, ffn: int, tp: int, b: int, s: int) -> dict:
    """FLOPs of one block's forward+backward on one rank (GEMMs 6·params·tokens, causal attention
    3.5 x the forward's 4·b·h·s²·d/2), before the recompute."""
    hd, hl, kvl = d // heads, max(heads // tp, 1), max(kv_heads // tp, 1)
    params = d * hd * (2 * hl + 2 * kvl) + 3 * d * (ffn // tp)
    return {
        "gemm": 6 * params * b * s,
        "attention": 3.5 * 2 * b * hl * s * s * hd,
        "params": params,
    }


def plan_command(
    d: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tp: int,
    b: int,
    s: int,
    vocab: int,
    gpu: str,
    precision: str,
) -> str:
    """The `dtrain plan` call that prices this block on ``gpu``: one layer, the rank's shard
    (tp), no SP."""
    return (
        f"dtrain plan --layers 1 --hidden {d} --heads {heads} --kv-heads {kv_heads} --ffn-hidden "
        f"{ffn} --gated-mlp --vocab {vocab} --seq {s} --gpus {tp} --gpu {gpu} --precision "
        f"{precision} --attention flash2 --kernels fused --global-batch {b} "
        + ("--fp8-scaling dynamic " if precision == "fp8" else "")  # torchao's, as the probe runs
        + f'--layout "dp=1 tp={tp} pp=1 recompute=full mb={b} sp=off" --json'
    )


def model_price(command: str) -> dict:
    """The cost model's terms for the block (seconds): `command` run, its layout's compute terms
    less the LM head and the optimizer step, which the probe does not run."""
    args = shlex.split(command)[1:]
    done = subprocess.run(
        [sys.executable, "-m", "dtrain.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip()[-300:]}
    terms = json.loads(done.stdout)["layout"]["step_time_s"]["compute_terms"]
    block = {k: v for k, v in terms.items() if k not in ("head", "optimizer")}
    return {"terms": block, "total": sum(block.values())}


def layer_probe(small: bool = False, micro_batches: tuple[int, ...] = ()) -> dict:
    """Each case at its own micro-batch, or at each of ``micro_batches`` (to see what grows with
    the tokens, the activations' casts, and what does not, the weights')."""
    dev = _device()
    cuda = dev.type == "cuda"
    out = []
    for name, dims in (SMALL_CASE if small else LAYER_CASES).items():
        for precision, mb in (
            (p, mb)
            for mb in micro_batches or (dims[5],)
            for p in (("bf16", "fp8") if cuda else ("bf16",))
        ):
            try:
                out.append(_layer_case(name, (*dims[:5], mb, *dims[6:]), precision, dev))
            except Exception as e:  # noqa: BLE001
                # one case that fails (memory, a missing kernel) leaves the rest
                out.append(
                    {
                        "case": name,
                        "precision": precision,
                        "error": f"{type(e).__name__}: {e}"[:400],
                    }
                )
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
    return {"device": _name(dev), "cases": out}


def _layer_case(name: str, dims: tuple, precision: str, dev: torch.device) -> dict:
    d, heads, kv_heads, ffn, tp, b, s, vocab = dims
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    # each case compiled static and afresh: no shared code object's recompile limit, no
    torch._dynamo.reset()
    # automatic dynamic shapes (their kernels are slower: a case timed after a size change measured
    # the wrong code)
    block = ShardBlock(d, heads, kv_heads, ffn, tp).to(
        dev, torch.bfloat16 if cuda else torch.float32
    )
    if precision == "fp8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(block)  # torchao's default: tensorwise dynamic scales
    run = torch.compile(block, dynamic=False) if cuda else block
    x = torch.randn(b, s, d, device=dev, dtype=block.wq.weight.dtype, requires_grad=True)
    dy = torch.randn_like(x)
    pos = torch.arange(s, device=dev, dtype=torch.float32)[:, None] / 10000 ** (
        torch.arange(0, block.hd, 2, device=dev, dtype=torch.float32) / block.hd
    )
    cos, sin = (f(pos).to(x.dtype)[None, :, None, :] for f in (torch.cos, torch.sin))
    flash = (
        torch.nn.attention.SDPBackend.FLASH_ATTENTION
    )  # FlashAttention-2, as the torchtitan rows ran

    def step():
        with torch.nn.attention.sdpa_kernel(flash) if cuda else nullcontext():
            y = torch.utils.checkpoint.checkpoint(run, x, cos, sin, use_reentrant=False)  # full AC
            y.backward(dy)
        x.grad = None
        block.zero_grad(set_to_none=True)

    step()  # compiles
    t = time_fn(step, warmup=2, iters=10 if cuda else 3, device=dev)
    per, launches, kernels = {}, {}, []
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        per, launches = gpu_time_by_category(prof.key_averages())
        top = sorted(
            (
                e
                for e in prof.key_averages()
                if e.device_type.name == "CUDA" and e.device_time_total
            ),
            key=lambda e: -e.device_time_total,
        )[:15]
        kernels = [
            {"name": e.key[:120], "s": e.device_time_total / 1e6, "count": int(e.count)}
            for e in top
        ]
    cmd = plan_command(d, heads, kv_heads, ffn, tp, b, s, vocab, gpu_profile(dev), precision)
    return {
        "case": name,
        "precision": precision,
        "d_model": d,
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn": ffn,
        "tp": tp,
        "micro_batch": b,
        "seq": s,
        "step_s": t.median,
        "step_s_spread": [min(t.samples_s), max(t.samples_s)],
        "gpu_s_by_category": per,
        "kernels_by_category": launches,
        "top_kernels": kernels,
        "flops": layer_flops(d, heads, kv_heads, ffn, tp, b, s),
        "plan_command": cmd,
        "model": model_price(cmd),
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
    }


def gpu_profile(dev: torch.device) -> str:
    """The hardware.yaml profile of this GPU; a GPU without one (or the CPU test) is priced as an
    H100 SXM."""
    return gpu_profile_name(_name(dev)) or "h100-sxm"
