"""Activation bytes per GPU of a transformer training step: one layer's, and the peak of the most
loaded pipeline stage.

Sources
-------
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (MLSys
  2023, arXiv:2205.05198), §4 and Table 2, with the per-tensor count of §4.1 generalised to any MLP
  ratio, SwiGLU and grouped KV heads (see ``activation_bytes_per_layer``); §4.2.3 for pipeline
  parallelism; Megatron's ``compute_activation_memory`` (18 + 4·F/h per layer, selective recompute
  + SP) is the same count for a GELU MLP.

Dropout is a property of the model (``ModelShape.dropout``): its 1-byte masks and the dropped-out
attention probabilities are counted only for a model trained with dropout.
"""

from __future__ import annotations

from dtrain.core.checks import one_of

from .shapes import RECOMPUTE, Layout, ModelShape, end_stage_layers, last_stage_layers


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool = False,
    *,
    ffn_mult: float = 4.0,
    gated_mlp: bool = False,
    kv_ratio: float = 1.0,
    dropout: bool = True,
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2).

    s sequence length, b micro-batch, h hidden size, a heads, t TP degree; 16-bit activations,
    1-byte dropout masks. Per-tensor count of §4.1, in units of s·b·h, F = ``ffn_mult``·h,
    r = ``kv_ratio`` = KV heads / heads (GQA stores smaller K and V):
      replicated under TP: 2 LayerNorm inputs 4, QKV input 2, fc1 input 2, 2 dropout masks 2 = 10
      TP-sharded:          Q 2 + K 2r + V 2r + output-projection input 2 = 4 + 4r;
                           MLP 2·(F/h) per stored tensor: 2 tensors for GELU (fc1 output, fc2
                           input), 3 for SwiGLU (gate and up outputs, fc2 input, as Megatron's
                           fused swiglu saves them)
      attention scores:    5·a·s/h (softmax output 2, its dropout mask 1, dropout output 2 per
                           a·s² element), TP-sharded
    ``dropout`` (default True: the paper's count) False drops the three dropout terms of §4.1: the
    attention-output and MLP-output masks (1 + 1 of the replicated 10, leaving 8) and, in the
    score term, the mask and the dropout output (3 of 5, leaving the softmax output 2·a·s/h,
    which the AV matmul reads directly). Without dropout, GPT (F = 4h, r = 1) stores
    s·b·h·(32 + 2·a·s/h) per layer.
    GPT (F = 4h, r = 1, GELU) with dropout gives the paper's numbers:
      no parallelism:        s·b·h·(34 + 5·a·s/h)                  (§4.1)
      TP, no SP:             s·b·h·(10 + 24/t + 5·a·s/(h·t))       (§4.2.1)
      TP + SP:               s·b·h/t·(34 + 5·a·s/h)                 (§4.2.2)
      selective recompute:   the same without the 5·a·s/h attention term (§5)
      full recompute:        2·s·b·h, only the layer input (§5, Table 2); with SP the saved input
                             is the sequence-sharded tensor, 2·s·b·h/t (Megatron's behaviour).
                             The layer being recomputed needs its full set once more: see
                             ``activation_bytes`` (the one-layer working set).
    ``flash_attention``: FlashAttention (Dao et al. 2022, §3.1) never stores the a·s² scores (it
    keeps the output, counted above, and an s·a log-sum-exp), so the score term is dropped as
    under selective recompute; without it ("eager" attention) selective recompute is what
    removes them.
    """
    one_of("recompute", recompute, RECOMPUTE, error=ValueError)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "op":
        return op_checkpoint_bytes(
            s, b, h, t, sequence_parallel, ffn_mult=ffn_mult, gated_mlp=gated_mlp, kv_ratio=kv_ratio
        )
    attn = 0.0 if recompute == "selective" or flash_attention else (5 if dropout else 2) * a * s / h
    sharded = 4 + 4 * kv_ratio + 2 * ffn_mult * (3 if gated_mlp else 2) + attn
    replicated = 10 if dropout else 8
    if sequence_parallel:
        return sbh / t * (replicated + sharded)
    return sbh * (replicated + sharded / t)


def op_checkpoint_bytes(
    s: int,
    b: int,
    h: int,
    t: int = 1,
    sequence_parallel: bool = False,
    *,
    ffn_mult: float = 4.0,
    gated_mlp: bool = False,
    kv_ratio: float = 1.0,
) -> float:
    """Bytes one layer keeps under torchtitan's selective op AC (``recompute="op"``).

    torchtitan ``apply_ac`` (``selective_ac_option="op"``): inside a checkpointed block, SDPA's
    output and the output of every odd-numbered matmul in forward order are saved (MUST_SAVE),
    everything else is recomputed in backward. A Llama block's matmuls run wq, wk, wv, wo, w1, w3,
    w2: saved are q, v, the attention output, w1's and w2's outputs, recomputed wk, wo, w3
    (``op_recompute_gemms``); a GELU block (wq, wk, wv, wo, w1, w2) saves q, v, the attention output
    and w1's output. Plus the block input, the checkpoint's own input. In units of s·b, 16-bit
    values, F = ``ffn_mult``·h:
      block input 2h (÷t with SP)   q 2h/t   v 2h·r/t   attention output 2h/t   w1 output 2F/t
      gated only: w2 output 2h (a row-parallel matmul's output is the full, not yet reduced, sum)
    No dropout masks (torchtitan's models have no dropout). Attention is taken to be SDPA (its
    output saved, its scores never stored), as in torchtitan and dtrain's model."""
    x = 2 * h / (t if sequence_parallel else 1)
    per_token = (
        x
        + (2 * h + 2 * h * kv_ratio + 2 * h + 2 * ffn_mult * h) / t
        + (2 * h if gated_mlp else 0.0)
    )
    return s * b * per_token


def layer_activation_bytes(
    shape: ModelShape, layout: Layout, flash_attention: bool = True, recompute: str | None = None
) -> float:
    """``activation_bytes_per_layer`` for one layer of ``shape`` under ``layout`` (its rank's
    s/cp tokens)."""
    return activation_bytes_per_layer(
        shape.seq_len // layout.cp,
        layout.micro_batch,
        shape.d_model,
        shape.n_head,
        layout.tp,
        layout.sequence_parallel,
        recompute or layout.recompute,
        flash_attention,
        ffn_mult=shape.ffn_hidden / shape.d_model,
        gated_mlp=shape.gated_mlp,
        kv_ratio=shape.n_kv_head / shape.n_head,
        dropout=shape.dropout,
    )


def in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    1F1B (Narayanan et al. 2021): min(pp, m); interleaved with v virtual stages that times
    1 + (pp−1)/(pp·v) (Korthikanti §4.2.3; Megatron ``compute_activation_memory``), at most m:
    when the warm-up, (v−1)·pp + 2(pp−1) chunk forwards on the first rank, covers all m·v of them
    (m = pp, as torchtitan's default), every micro-batch is in flight at once, as under GPipe;
    zero-bubble V the same as 1F1B (Qi et al. 2024: ZB-V keeps 1F1B's peak); GPipe all m (every
    forward runs before the first backward, Huang et al. 2019). Without PP one."""
    lay = layout
    if lay.pp == 1:
        return 1.0
    if lay.pp_schedule == "gpipe":
        return float(lay.grad_accum)
    n = float(min(lay.pp, lay.grad_accum))
    if lay.virtual_stages > 1 and lay.pp_schedule != "zbv":
        n = min(n * (1 + (lay.pp - 1) / (lay.pp * lay.virtual_stages)), float(lay.grad_accum))
    return n


def held_layer_microbatches(shape: ModelShape, layout: Layout) -> float:
    """Layer activations (one layer for one micro-batch each) the first stage holds at its peak:
    ``in_flight`` micro-batches through its layers, where the interleaved warm-up's extra ones
    have run only its first chunk (Megatron's schedule: chunk forwards in rounds of pp
    micro-batches, the pp−1 beyond v·pp in chunk 0). With equal chunks that is ``in_flight`` x
    the stage's layers; the "balanced" split's first chunk holds one layer fewer
    (``shapes.end_stage_layers``)."""
    first, first_chunk = end_stage_layers(shape, layout)
    n = in_flight(layout)
    if (
        layout.virtual_stages == 1 or layout.pp_schedule != "1f1b" or layout.pp == 1
    ):  # GPipe, ZB-V: whole stages
        return n * first
    full = float(min(layout.pp, layout.grad_accum))
    return full * first + (n - full) * layout.virtual_stages * first_chunk


# Bytes per logit the loss holds at its peak: a fused vocab-parallel cross-entropy works on the fp32
# logits in place (Megatron's count, 4); PyTorch's unfused F.cross_entropy over bf16 logits holds
# the bf16 logits (2), their fp32 copy (4), the log-softmax (4) and the gradient (4): 14.
# torchtitan's Llama 3.1 8B on 8 H100 (mb 2, seq 8192, vocab 128256: 2.1G logits) reported 82.4 GiB
# (docs/performance.md 2024-12, Table
# 1) where the layer activations and states count 59 GiB: the 21 GiB of the difference are these 10
# extra bytes per logit.
LOSS_BYTES_PER_LOGIT = {"fused": 4, "eager": 14}


def activation_bytes(
    shape: ModelShape,
    layout: Layout,
    activation_bytes_factor: float = 1.0,
    flash_attention: bool = True,
    fused_loss: bool = True,
) -> float:
    """Peak activation bytes on the most loaded pipeline stage.

    The first stage holds ``held_layer_microbatches`` (``in_flight`` micro-batches, each through its
    layers) plus their embedding-layer inputs: the token ids (8·s·b) and, with dropout, its mask
    (s·b·h) (Megatron ``compute_activation_memory``). The last stage holds one micro-batch plus the
    output layer's input, 4·s·b·h/tp, and the loss's logits, ``LOSS_BYTES_PER_LOGIT`` x s·b·V/tp
    (vocab-parallel; 4 bytes fused as Megatron counts them, 14 in unfused PyTorch). Full recompute
    adds the working set of the one layer being recomputed: its activations without recompute, once
    (so does ``op``, which recomputes part of each layer). Without sequence parallelism the
    replicated tensors add 5% of temporaries, as Megatron's precise count without SP does
    (``compute_activation_memory_without_sp``: "buffer for optimizer and miscellaneous
    temporaries"). ``activation_bytes_factor`` scales the layer activations: ~0.8 when an FP8 recipe
    caches the linear-layer inputs in 1 byte instead of 2, see ``Calibration.fp8_memory_factor`` (an
    approximation; fp8-train measures it). With context parallelism every count is of the rank's
    s/cp tokens, plus the attention's communication buffers (``cp_buffer_bytes``).
    """
    lay = layout
    s, b, h = (
        shape.seq_len // lay.cp,
        lay.micro_batch,
        shape.d_model,
    )  # a rank's tokens: s/cp of each sequence
    per_layer = layer_activation_bytes(shape, lay, flash_attention) * activation_bytes_factor
    working = 0.0
    if lay.recompute in ("full", "op"):
        working = (
            layer_activation_bytes(shape, lay, flash_attention, "none") * activation_bytes_factor
        )
    working += cp_buffer_bytes(shape, lay)
    last_layers = last_stage_layers(shape, lay)
    output = (
        4 * s * b * h
        + LOSS_BYTES_PER_LOGIT["fused" if fused_loss else "eager"] * s * b * shape.vocab
    ) / lay.tp
    n = in_flight(lay)
    embed = n * (8 * s * b + (s * b * h if shape.dropout else 0)) / lay.tp
    first = per_layer * held_layer_microbatches(shape, lay) + working + embed
    last = per_layer * last_layers + working + output
    total = first + output if lay.pp == 1 else max(first, last)
    return total * (1.0 if lay.sequence_parallel else 1.05)


def cp_buffer_bytes(shape: ModelShape, layout: Layout) -> float:
    """The working buffers of one layer's context-parallel attention (16-bit), on one TP rank:
    ring  the K and V chunk being received while the local one is used (double buffering), and in
          backward their gradients travelling the other way: 2 x 2 x b·(s/cp)·kv_local·hd
    ulysses   the all-to-all's full-sequence q, k, v and output for the rank's heads/cp: 2·b·s·(q +
              2kv + q)/cp
    torch     PyTorch's all-gathered K and V, repeated to the query heads, 2·2·b·s·q, and in
              backward the fp32
              dK, dV chunk accumulated and the one in flight, 2·2·4·b·(s/cp)·q"""
    if layout.cp <= 1:
        return 0.0
    b, s, t, cp = layout.micro_batch, shape.seq_len, layout.tp, layout.cp
    hd = shape.d_model // shape.n_head
    kv = max(shape.n_kv_head // t, 1) * hd
    q = max(shape.n_head // t, 1) * hd
    if layout.cp_impl == "ulysses":
        return 2 * b * s * (2 * q + 2 * kv) / cp
    if layout.cp_impl == "torch":
        return max(2 * 2 * b * s * q, 2 * 2 * 4 * b * (s / cp) * q)
    return 2 * 2 * 2 * b * (s / cp) * kv
