"""What one block of dtrain's GPT keeps for backward under autocast, and the step's peak: counted on
this CPU, for the cost model's trainer memory (``costmodel.stack_memory.autocast_layer_bytes``).

    python -m dtrain.gpucheck.saved_tensors [--preset 125m] [--widths 256 384] [--compile]

``saved``: a forward of the blocks under bf16 autocast (fp32 parameters and residual stream, as
the trainer runs without FSDP) inside ``torch.autograd.graph.saved_tensors_hooks``; every tensor
autograd packs is counted once by its storage, parameters left out, and the bf16 weight copies
(autocast's, 2 B per linear weight) reported apart from the activations. The hooks see the tensors
a compiled block saves as well (``--compile``: ``nn.Module.compile`` per block, as
``train.compile``), so the count is the partitioner's choice. Reported per token and layer in units
of d_model, at two widths: a count that holds at both is per-token bytes, not a size artefact.
``--fp8``: torchao's tensorwise float8 on the blocks' linears (emulated here).

``peak``: the live bytes of a whole eager training step (forward, loss, backward) above its start,
from the profiler's allocation events, at two sequence lengths and two vocabularies: the slopes are
the bytes per token the step peaks at and the loss's bytes per logit. ``--fsdp``: the step under
FSDP2 on one gloo rank (each block and the root ``fully_shard``, bf16 parameters and fp32
reduction, no autocast), as the trainer's zero2/zero3 runs it.

Both run on the CPU. CPU autocast and kernels differ from CUDA's in one place that matters: the CPU
``rms_norm`` is composite and also saves x/rms (2 x 4 B per element per block), where CUDA's fused
kernel keeps x and 1/rms; the LayerNorm presets (125m, 350m) run the same kernel on both.
"""

from __future__ import annotations

import argparse
import json

import torch

BATCH, LAYERS = 2, 2


def _model(preset: str, width: int, seq: int, vocab: int, fp8: bool, compiled: bool):
    from dtrain.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.from_preset(
        preset, d_model=width, n_head=4, n_kv_head=4, n_layer=LAYERS, seq_len=seq, vocab_size=vocab
    )
    model = GPT(cfg)
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            module_filter_fn=lambda _m, fqn: fqn.startswith("blocks."),
            config=Float8LinearConfig(emulate=True),
        )
    if compiled:
        for block in model.blocks:
            block.compile()
    return model


def saved(
    preset: str, width: int, seq: int = 256, fp8: bool = False, compiled: bool = False
) -> dict[str, float]:
    """Bytes the blocks keep for backward per token and layer, in units of ``width``: the
    activations, and autocast's bf16 weight copies (per token only at this size)."""
    model = _model(preset, width, seq, 512, fp8, compiled)
    x = torch.randint(0, 512, (BATCH, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def blocks():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.tok_emb(x) + model.pos_emb(torch.arange(seq))
            for block in model.blocks:
                h = block(h)
        return h

    blocks().float().sum().backward()  # compiles outside the count
    kept: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        weight = t.dim() == 2 and t.shape[0] != BATCH * seq and t.dtype == torch.bfloat16
        kept.setdefault(storage.data_ptr(), (storage.nbytes(), weight))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks()
    per = BATCH * seq * LAYERS * width
    acts = sum(n for k, (n, w) in kept.items() if k not in params and not w and n > 8)
    casts = sum(n for k, (n, w) in kept.items() if k not in params and w)
    return {"activations_per_d": acts / per, "weight_casts_per_d": casts / per}


def peak(preset: str, width: int, seq: int, vocab: int, fsdp: bool = False) -> float:
    """Live bytes at the peak of one eager training step above its start: bf16 autocast, or
    FSDP2's bf16 mixed precision (``fsdp``: needs a one-rank process group)."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    model = _model(preset, width, seq, vocab, False, False)
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    x = torch.randint(0, vocab, (BATCH, seq))
    amp = nullcontext() if fsdp else torch.autocast("cpu", dtype=torch.bfloat16)

    def step():
        with amp:
            loss = model(x, x)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = top = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        top = max(top, live)
    return float(top)


def peak_slopes(
    preset: str, width: int, seqs=(512, 1024), vocabs=(512, 8192), fsdp: bool = False
) -> dict:
    """The peak's bytes per token (at the smaller vocabulary, its logits' share taken out) and
    per logit, from the step's peak at two sequence lengths and two vocabularies. The slopes hold
    while the peak falls at the same moment in all four steps: under FSDP2 at width 384, 512 and
    1024 tokens a sequence give 56.9h and 12.6 B (the peak moves), 1024 and 2048 give 69.1h and
    12.0 B, as width 256 does at either pair."""
    (s0, s1), (v0, v1) = seqs, vocabs
    slope = {
        v: (peak(preset, width, s1, v, fsdp) - peak(preset, width, s0, v, fsdp))
        / (BATCH * (s1 - s0))
        for v in (v0, v1)
    }
    per_logit = (slope[v1] - slope[v0]) / (v1 - v0)
    per_token = slope[v0] - per_logit * v0
    return {"per_token_per_d": per_token / width, "per_logit": per_logit}


def _peak(preset: str, width: int, fsdp: bool) -> dict:
    if not fsdp:
        return peak_slopes(preset, width)
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return {**peak_slopes(preset, width, fsdp=True), "fsdp": 2}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.saved_tensors")
    p.add_argument("--preset", default="125m")
    p.add_argument("--widths", type=int, nargs=2, default=[256, 384])
    p.add_argument("--compile", action="store_true", help="also count compiled blocks")
    p.add_argument("--fp8", action="store_true", help="also count torchao float8 linears")
    p.add_argument("--peak", action="store_true", help="also the eager step's peak slopes")
    p.add_argument("--fsdp", action="store_true", help="the peak under FSDP2 (one gloo rank)")
    a = p.parse_args(argv)
    out: dict = {"preset": a.preset, "saved": {}}
    for compiled in (False, True) if a.compile else (False,):
        for fp8 in (False, True) if a.fp8 else (False,):
            name = ("compiled" if compiled else "eager") + (" fp8" if fp8 else " bf16")
            out["saved"][name] = [saved(a.preset, w, fp8=fp8, compiled=compiled) for w in a.widths]
            got = ", ".join(f"{r['activations_per_d']:.2f}" for r in out["saved"][name])
            print(f"{name:14s} activations per token and layer: {got} x d_model ({a.widths})")
    if a.peak:
        out["peak"] = _peak(a.preset, a.widths[0], a.fsdp)
        print(
            f"{'FSDP2' if a.fsdp else 'autocast'} step peak: "
            f"{out['peak']['per_token_per_d']:.1f} x d_model per token "
            f"({LAYERS} layers and the head), {out['peak']['per_logit']:.1f} B per logit"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
