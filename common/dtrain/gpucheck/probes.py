"""Two probes of `make gpu-check` that test the cost model's compute and overlap terms on one GPU:

    python -m dtrain.gpucheck.probes layer_probe | contention [--small]

layer_probe   One transformer block of a published model at the shard one GPU of its layout runs
              (Llama 3.1
              405B at TP8: 16 of 128 query heads, 1 of 8 KV heads, 6656 of 53248 FFN columns; Llama
              3.1 8B whole), the way torchtitan runs it: RMSNorm, RoPE, K/V repeated to the query
              heads, SDPA's flash backend, SwiGLU, full activation checkpointing, torch.compile,
              bf16 or torchao's tensorwise float8. Forward+backward timed, and its GPU time by
              kernel category (profiler). The cost model prices the same block on the same GPU with
              `dtrain plan --layers 1 ...` (the `plan_command` each case prints), so measured /
              predicted is one number per case. Without sequence parallelism the norms run on every
              token, as the model is asked to price them.
contention    What a transfer running beside compute costs: a victim (bf16 GEMMs, memory-bound adds,
              a Llama
              block's forward+backward) and a transfer of about half its time started together on
              two streams; the share of the transfer the overlap did not hide, (makespan - victim
              alone) / transfer alone, what ``collectives.overlap_cost`` prices. The transfer is an
              SM copy kernel of C thread blocks (NCCL's ring kernel holds one block per channel and
              copies through HBM) or the copy engines (device -> host over PCIe, no SMs: about one
              NIC's rate); beside each, its SM share C/SMs and its HBM share (bytes read + written
              per second over the HBM rate).

`--small` runs the layer probe at CPU sizes in fp32 without compile (the tests); contention needs
CUDA.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.costmodel.hardware import get_profile, gpu_profile_name
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
    cmd = plan_command(d, heads, kv_heads, ffn, tp, b, s, vocab, _gpu_profile(dev), precision)
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


def _gpu_profile(dev: torch.device) -> str:
    """The hardware.yaml profile of this GPU; a GPU without one (or the CPU test) is priced as an
    H100 SXM."""
    return gpu_profile_name(_name(dev)) or "h100-sxm"


def _sm_copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):  # persistent: C blocks stride over the buffer
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for off in range(start, n, step):
            idx = off + tl.arange(0, BLOCK)
            tl.store(dst + idx, tl.load(src + idx, mask=idx < n), mask=idx < n)

    return copy


def contention(small: bool = False) -> dict:
    """Each victim V (alone: T_v) and a transfer C sized to about half of it (alone: T_c) started
    together on two streams; the makespan M of both. The share of the transfer that overlap did not
    hide is
    cost = (M - T_v) / T_c: 0 when it hides wholly, 1 when the two ran one after the other. The
    victim's own stretch (its end - T_v) and the transfer's (its end - T_c) are kept apart beside
    it."""
    dev = _device()
    if dev.type != "cuda":
        return {"skipped": "contention needs a CUDA GPU (a side stream beside the compute)"}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hbm = (
        get_profile(_gpu_profile(dev)).hbm_tbps * 1e12
    )  # the datasheet rate the HBM share is taken against
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g)
    bm = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g)
    big = [
        torch.randn(2**28, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3)
    ]  # 512 MiB each
    block = ShardBlock(4096, 32, 8, 14336, 1).to(dev, torch.bfloat16)  # Llama 3.1 8B's block, eager
    x = torch.randn(
        1, 4096, 4096, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True
    )
    pos = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] / 10000 ** (
        torch.arange(0, 128, 2, device=dev, dtype=torch.float32) / 128
    )
    cos, sin = (f(pos).to(torch.bfloat16)[None, :, None, :] for f in (torch.cos, torch.sin))

    def block_step():
        block(x, cos, sin).sum().backward()
        x.grad = None
        block.zero_grad(set_to_none=True)

    victims = {
        "gemm_bf16_8192x10": lambda: [torch.mm(a, bm) for _ in range(10)],
        "add_512MiBx40": lambda: [torch.add(big[0], big[1], out=big[2]) for _ in range(40)],
        "llama3_8b_block_fwd_bwd": block_step,
    }
    src = torch.empty(2**27, device=dev, dtype=torch.bfloat16)  # 256 MiB each way: 4x the L2
    dst = torch.empty_like(src)
    host = torch.empty(2**26, dtype=torch.bfloat16, pin_memory=True)  # 128 MiB
    kern = _sm_copy_kernel()
    side = torch.cuda.Stream(dev)
    # (launch, HBM bytes read + written per launch, thread blocks held)
    aggressors = {
        f"sm_copy_{c}": (
            (lambda c=c: kern[(c,)](src, dst, src.numel(), BLOCK=4096)),
            4 * src.numel(),
            c,
        )
        for c in (8, 16, 32)
    }
    # PCIe through the copy engines (a NIC's rate, no SMs): HBM read once per byte
    aggressors["ce_d2h"] = (
        lambda: host.copy_(dst[: host.numel()], non_blocking=True),
        2 * host.numel(),
        0,
    )

    def ev():
        return torch.cuda.Event(enable_timing=True)

    def alone(fn, stream) -> float:
        with torch.cuda.stream(stream):
            fn()  # warm (and compile the Triton kernel)
            runs = []
            for _ in range(3):
                s, e = ev(), ev()
                s.record()
                fn()
                e.record()
                e.synchronize()
                runs.append(s.elapsed_time(e) / 1e3)
        return statistics.median(runs)

    rows = []
    for vname, victim in victims.items():
        t_v = alone(victim, torch.cuda.current_stream(dev))
        for aname, (launch, nbytes, blocks) in aggressors.items():
            one = alone(launch, side)
            n = max(1, round(0.5 * t_v / one))

            def batch(launch=launch, n=n):
                return [launch() for _ in range(n)]

            t_c = alone(batch, side)
            spans = []
            for _ in range(3):
                torch.cuda.synchronize()
                start, end_v, end_c = ev(), ev(), ev()
                start.record()
                side.wait_event(start)
                with torch.cuda.stream(side):
                    batch()
                    end_c.record()
                victim()
                end_v.record()
                torch.cuda.synchronize()
                spans.append((start.elapsed_time(end_v) / 1e3, start.elapsed_time(end_c) / 1e3))
            v_end = statistics.median(sp[0] for sp in spans)
            c_end = statistics.median(sp[1] for sp in spans)
            m = statistics.median(max(sp) for sp in spans)
            rows.append(
                {
                    "victim": vname,
                    "aggressor": aname,
                    "victim_s": t_v,
                    "transfer_s": t_c,
                    "makespan_s": m,
                    "victim_end_s": v_end,
                    "transfer_end_s": c_end,
                    "cost": (m - t_v) / t_c,
                    "victim_stretch": v_end / t_v - 1,
                    "transfer_stretch": c_end / t_c - 1,
                    "transfer_GBps_rw": n * nbytes / t_c / 1e9,
                    "sm_share": blocks / sms,
                    "hbm_share": n * nbytes / t_c / hbm,
                }
            )
    return {"device": _name(dev), "sms": sms, "hbm_Bps": hbm, "rows": rows}


PROBES = {"layer_probe": layer_probe, "contention": contention}


def _micro_batches(text: str) -> tuple[int, ...]:
    """--micro-batches: positive integers, comma-separated (1,2,3)."""
    try:
        mbs = tuple(int(m) for m in text.split(","))
    except ValueError:
        mbs = ()
    if not mbs or min(mbs) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive micro-batches (1,2,3)"
        )
    return mbs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.probes")
    p.add_argument("name", choices=sorted(PROBES))
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (tests)")
    p.add_argument(
        "--micro-batches",
        type=_micro_batches,
        default=(),
        help="layer_probe: comma-separated micro-batches (default: each case's own)",
    )
    args = p.parse_args(argv)
    if not (
        args.small or torch.cuda.is_available()
    ):  # the published shapes would run for hours on a CPU
        print(
            f"error: {args.name} needs a CUDA GPU (torch here sees none): run it on one, or pass "
            "--small for the CPU test sizes",
            file=sys.stderr,
        )
        raise SystemExit(2)
    kwargs = {"micro_batches": args.micro_batches} if args.name == "layer_probe" else {}
    print(json.dumps(PROBES[args.name](small=args.small, **kwargs)), flush=True)


if __name__ == "__main__":
    main()
