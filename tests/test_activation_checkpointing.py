"""Activation checkpointing levels of the shared trainer (train.activation_checkpointing): the same
gradients as no checkpointing, and saved bytes that order none > op > block, matching the cost
model's op count (activations.op_checkpoint_bytes) for the tensors the policy saves."""

from __future__ import annotations


import pytest
import torch

from dtrain.costmodel.activations import op_checkpoint_bytes
from dtrain.model.gpt import GPT, GPTConfig
from dtrain.train.parallelize import apply_activation_checkpointing

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, seq_len=32, vocab_size=128)


def _tensor_bytes(entry) -> int:
    """Bytes of the tensors in one cached output (torch wraps each in a version check)."""
    if isinstance(entry, (tuple, list)):
        return sum(_tensor_bytes(e) for e in entry)
    val = getattr(entry, "val", None)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _run(mode: str, seed: int = 0):
    """(loss, grads by parameter name, bytes the op policy cached for backward) of one step."""
    from dtrain.train import parallelize

    torch.manual_seed(seed)
    model = GPT(CFG)
    contexts = []
    real = parallelize._op_policy_context

    def recording():
        pair = real()
        contexts.append(pair[0])  # the caching mode of this block call
        return pair

    parallelize._op_policy_context = recording
    try:
        if mode != "none":
            apply_activation_checkpointing(model, mode)
        idx = torch.randint(
            0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(seed)
        )
        loss = model(idx, idx)
        cached = sum(
            _tensor_bytes(out)
            for c in contexts[: CFG.n_layer]
            for outs in c.storage.values()
            for out in (outs.values() if isinstance(outs, dict) else outs)
        )
        loss.backward()
    finally:
        parallelize._op_policy_context = real
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for n, p in model.named_parameters()
    }
    return loss.item(), grads, cached


def test_op_and_block_checkpointing_give_the_gradients_of_none():
    loss0, g0, _ = _run("none")
    for mode in ("op", "block"):
        loss, g, _ = _run(mode)
        assert loss == pytest.approx(loss0, abs=1e-6), mode
        assert g.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(
                g[name], g0[name], rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}"
            )


def test_op_caches_what_the_cost_model_counts():
    """The op policy keeps q, v, the attention output and w1's output per block: the cost model's
    op_checkpoint_bytes without the block input (saved by the checkpoint itself), in fp32 (2x the
    16-bit count), plus SDPA's log-sum-exp (b·heads·s floats) that the model leaves out as small."""
    _, _, cached = _run("op")
    s, b, h, heads = CFG.seq_len, 2, CFG.d_model, CFG.n_head
    r = CFG.n_kv_head / CFG.n_head
    per_block = 2 * (
        op_checkpoint_bytes(s, b, h, kv_ratio=r, ffn_mult=CFG.mlp_ratio) - 2 * s * b * h
    )
    lse = b * heads * s * 4
    print(
        f"cached {cached} bytes, modelled {CFG.n_layer * per_block} + log-sum-exp "
        f"{CFG.n_layer * lse}"
    )
    assert cached == CFG.n_layer * (per_block + lse)


def test_op_policy_saves_every_other_matmul_and_sdpa():
    """The policy's own record: what the op-level checkpoint of one block keeps."""
    from torch.utils.checkpoint import CheckpointPolicy

    from dtrain.train import parallelize

    ctx_fn = parallelize._op_policy_context
    fwd, _ = ctx_fn()
    policy = fwd.policy_fn if hasattr(fwd, "policy_fn") else None
    if policy is None:
        pytest.skip("this torch keeps the policy private")

    class Ctx:
        is_recompute = False

    mm = torch.ops.aten.mm.default
    got = [policy(Ctx, mm) for _ in range(6)]  # wq, wk, wv, wo, w1, w2
    assert got == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 3
    assert policy(Ctx, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_op_checkpoint_bytes_by_hand():
    # s=32, b=2, h=64, t=1, GELU 4h, GQA r=1/2: x 2h + q 2h + v 2h·r + attn 2h + w1 2·4h =
    # 2s·b·h·(1+1+0.5+1+4)
    assert op_checkpoint_bytes(32, 2, 64, kv_ratio=0.5) == 32 * 2 * 64 * 2 * 7.5
    # SwiGLU adds w2's unreduced output 2h; TP 2 with SP shards everything but that
    assert op_checkpoint_bytes(
        32, 2, 64, 2, True, gated_mlp=True, ffn_mult=3.5, kv_ratio=0.5
    ) == 32 * 2 * (2 * 64 / 2 + (2 * 64 + 64 + 2 * 64 + 7 * 64) / 2 + 2 * 64)
