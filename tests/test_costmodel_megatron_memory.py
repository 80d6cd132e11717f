"""The memory model against Megatron-LM's own count
(``megatron/training/theoretical_memory_usage.py``):
for Megatron-style layouts (GPT with a 4h GELU MLP, dropout, multi-head attention; distributed
optimizer or not; TP with and without sequence parallelism; 1F1B and interleaved pipelines) the
weight + optimizer bytes and the activation bytes each agree within 3% (issue 21).

``megatron_reference`` is an independent transcription of that file's formulas (compute_weight_and_
optimizer_memory, compute_activation_memory for SP + selective recompute, compute_activation_memory_
without_sp otherwise), not a call into dtrain's model."""

from __future__ import annotations

import pytest

from dtrain.costmodel.memory import memory_per_gpu
from dtrain.costmodel.shapes import Layout, ModelShape


def megatron_reference(L, h, a, V, s, b, tp, pp, dp, m, v=None, dist_opt=True, sp=True):
    """(weight + optimizer bytes, activation bytes) per GPU by Megatron-LM's formulas (LayerNorm,
    no GQA, GELU MLP of 4h, untied embeddings)."""
    ffn = 4 * h
    layer = 2 * h * (ffn + 2) + 2 * h * h * 2  # MLP + 2 LayerNorms (weight, bias) + q, k, v, o
    emb = h * V
    block = layer * L + 2 * h  # + final LayerNorm
    shard = (block / pp + emb) / tp + (emb / tp if pp == 1 else 0)
    weights = shard * (6 + 12 / dp if dist_opt else 18)
    # compute_activation_memory (SP + selective recompute) / compute_activation_memory_without_sp:
    # the layers' activations plus the embedding's inputs, scaled alike for the pipeline's in-flight
    # micro-batches
    per_layer = (18 + 4 * ffn / h) if sp else (10 + 24 / tp)
    act = s * b * h * per_layer * L + 8 * s * b * pp + s * b * h * pp
    if v:
        act *= 1 + (pp - 1) / (pp * v)
    elif pp > 1:
        act *= min(1, m / pp)
    if sp:
        if pp == 1:  # output layer: its input and the logits
            act += s * b * h * 4 * (1 + V / h)
        return weights, act / tp
    if pp == 1:
        act += (s * b * V / tp + s * b * h) * 2
    return weights, act * 1.05


CASES = [  # L, h, a, V, s, b, tp, pp, dp, m, v, dist_opt, sp
    (40, 6144, 48, 51200, 2048, 1, 8, 1, 32, 32, None, False, True),  # SC'21 18.4B, SP
    (96, 12288, 96, 51200, 2048, 1, 8, 8, 24, 96, 2, True, True),  # GPT-3 175B-like, interleaved
    (48, 8192, 64, 51200, 2048, 2, 4, 4, 8, 16, None, True, True),  # 1F1B, m >= pp
    (48, 8192, 64, 51200, 2048, 1, 4, 4, 8, 2, None, True, True),  # 1F1B, m < pp
    (36, 4096, 32, 51200, 2048, 4, 4, 1, 16, 8, None, False, False),  # TP without SP
    (60, 10240, 80, 51200, 4096, 1, 8, 4, 4, 32, 3, True, False),  # interleaved, no SP
    (
        40,
        6144,
        48,
        51200,
        2048,
        1,
        1,
        1,
        64,
        8,
        None,
        True,
        False,
    ),  # plain DP, distributed optimizer
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"L{c[0]}-h{c[1]}-tp{c[6]}-pp{c[7]}-v{c[10]}-sp{c[12]}"
)
def test_breakdown_agrees_with_megatron_theoretical_memory_within_3pct(case):
    L, h, a, V, s, b, tp, pp, dp, m, v, dist_opt, sp = case
    ref_w, ref_act = megatron_reference(L, h, a, V, s, b, tp, pp, dp, m, v, dist_opt, sp)
    shape = ModelShape(L, h, a, a, V, s, 4.0, False, dropout=True, rotary=False)
    lay = Layout(
        dp_shard=dp,
        tp=tp,
        pp=pp,
        zero_stage=1 if dist_opt else 0,
        recompute="selective",
        micro_batch=b,
        grad_accum=m,
        sequence_parallel=sp and tp > 1,
        pp_virtual=v or 1,
    )
    mem = memory_per_gpu(shape, lay, flash_attention=False)
    print(
        f"weights+optimizer {mem.params + mem.grads + mem.optimizer:.4g} vs Megatron {ref_w:.4g}; "
        f"activations {mem.activations:.4g} vs {ref_act:.4g}"
    )
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(ref_w, rel=0.03)
    assert mem.activations == pytest.approx(ref_act, rel=0.03)


def test_output_layer_counts_fp32_logits_as_megatrons_sp_count_does():
    """Megatron's two activation counts disagree on the logits: 4 bytes per logit (and 4 per
    hidden value) with SP, 2 bytes without. The model keeps fp32 logits for the loss in both;
    this pins the difference to exactly that term, so a small model with a large batch (where
    logits weigh) is explained."""
    L, h, a, V, s, b = 24, 2304, 24, 51200, 2048, 8
    shape = ModelShape(L, h, a, a, V, s, 4.0, False, dropout=True, rotary=False)
    mem = memory_per_gpu(
        shape,
        Layout(dp_shard=32, zero_stage=0, recompute="selective", micro_batch=b, grad_accum=2),
        flash_attention=False,
    )
    _, ref = megatron_reference(L, h, a, V, s, b, 1, 1, 32, 2, None, False, False)
    assert mem.activations - ref == pytest.approx(
        1.05 * (4 * s * b * (h + V) - 2 * (s * b * V + s * b * h)), rel=1e-9
    )
