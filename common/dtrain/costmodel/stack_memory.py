"""Peak memory per GPU on a software stack: ``memory.memory_per_gpu`` with the stack's fields that
move memory, and the peak of the eager FSDP stack and of dtrain's own trainer (``eager_peak``),
whose blocks' activations are the tensors PyTorch keeps, counted on a CPU
(``autocast_layer_bytes``, ``counted_block``). Apart from memory.py so that the eager stack's terms
(eager.py) and the memory model import neither each other."""

from __future__ import annotations

from .activations import layer_activation_bytes
from .eager import linear_params
from .memory import MemoryBreakdown, memory_per_gpu
from .model_states import fsdp2_state_bytes, params_per_gpu
from .shapes import Layout, ModelShape, stage_layers
from .stack import TRAINER_SOFTWARE, Stack


def memory_for(
    shape: ModelShape,
    layout: Layout,
    stack: Stack,
    activation_bytes_factor: float = 1.0,
    precision: str = "bf16",
) -> MemoryBreakdown:
    """``memory_per_gpu`` on ``stack``: the one place that knows which of its fields move memory
    (the attention kernel, the loss, the gradient and optimizer-state dtypes); the eager FSDP
    stack's peak is ``eager_peak``'s, and so is dtrain's trainer's where it runs under autocast
    (``traced_layer``), compiled or not, where its own counts replace ``activation_bytes_factor``
    (``precision``: "bf16" or "fp8", torchao's float8 on the blocks' linears)."""
    traced = traced_layer(shape, layout, stack)
    base = memory_per_gpu(
        shape,
        layout,
        1.0 if traced else activation_bytes_factor,
        stack.flash,
        stack.fused_loss,
        stack.grad_bytes,
        stack.optimizer_states,
    )
    if stack.software != "fsdp-eager" and not traced:
        return base
    return eager_peak(
        shape,
        layout,
        base,
        stack.optimizer,
        precision if traced else "",
        stack.kernels == "fused",
        stack.flash,
        exact=traced or counted_block(shape, layout, stack),
    )


def counted_block(shape: ModelShape, layout: Layout, stack: Stack) -> bool:
    """True where the step's peak is the count of its tensors (``dtrain.gpucheck.saved_tensors
    --peak``, with ``--fsdp`` under FSDP2: per token 2 x 32h + 4h for two of dtrain's GPT blocks
    and the head, against 69.2h measured at two widths, and 12.0 B per logit): dtrain's trainer
    or the eager stack, eager kernels, no recompute, a block like dtrain's GPT. Elsewhere
    ``activations.py`` keeps Megatron's 5% for temporaries."""
    return stack.kernels == "eager" and _gpt_block(shape, layout, stack)


def _gpt_block(shape: ModelShape, layout: Layout, stack: Stack) -> bool:
    """dtrain's trainer (or the eager stack) without recompute on a block like dtrain's GPT: a
    dense GELU MLP, learned positions (no RoPE), no dropout: the block the counts are of."""
    dense_gpt = not (shape.gated_mlp or shape.rotary or shape.dropout)
    return stack.software in TRAINER_SOFTWARE and layout.recompute == "none" and dense_gpt


def traced_layer(shape: ModelShape, layout: Layout, stack: Stack) -> bool:
    """True where ``autocast_layer_bytes`` counts a block's saved tensors: dtrain's trainer (or the
    eager stack) under autocast (no FSDP: ZeRO below 2), without recompute, on a dense GELU block
    like dtrain's GPT; compiled blocks are counted for this model only."""
    return layout.zero_stage < 2 and _gpt_block(shape, layout, stack)


def autocast_layer_bytes(shape: ModelShape, layout: Layout, compiled: bool, precision: str):
    """Bytes per token one block of dtrain's GPT keeps for backward under autocast (fp32
    parameters and residual stream, bf16 matmuls), as PyTorch saves them. Counted from the tensors
    autograd's saved-tensor hooks see in a forward on this CPU (``dtrain.gpucheck.saved_tensors``:
    the same count at two widths), with the norm's saved output dropped (CUDA's fused RMSNorm
    keeps its input and 1/rms only; CPU's composite one also keeps x/rms, 2 x 4h). Per token, h_r
    the width of the replicated tensors (h, or h/t with SP), q, k, v, out the attention's
    (FlashAttention's output is the output projection's input), F the MLP width:
      eager     norm inputs 2 x 4h_r (fp32), the norm output cast to bf16 once per linear that
                reads it (q, k, v: 3 x 2h_r; fc1 2h_r), q 2h, k, v 2hr, out 2h, fc1's output and
                the GELU's 2 x 2F: 40h for GPT (r 1, F 4h); torchao float8 the same (its linears
                save their bf16 input)
      compiled  the block input 4h_r (fp32; the second norm's input is recomputed), the norm
                outputs in bf16 once each (2 x 2h_r), q, k, v, out, a copy of out laid out for
                the output projection 2h, and fc1's and the GELU's outputs: 34h;
                FP8 (torchao) keeps the block input, q, k, v, out, out's copy and fc1's output
                only, recomputing the norms and every cast from them: 22h
    Against one H100's runs (7B, 4 layers, 2 x 4096 tokens; eager and compiled, bf16 and FP8, 1
    and 4 micro-batches) the peaks these give are -1.9% to -1.2% (dtrain backtest --measured)."""
    t, h = layout.tp, shape.d_model
    h_r = h / t if layout.sequence_parallel else h
    f = shape.ffn_hidden / t
    attn = (4 * h + 4 * h * shape.n_kv_head / shape.n_head) / t
    if not compiled:
        return 2 * 4 * h_r + 4 * 2 * h_r + attn + 4 * f
    if precision == "fp8":
        return 4 * h_r + attn + 2 * h / t + 2 * f
    return 4 * h_r + 2 * 2 * h_r + attn + 2 * h / t + 4 * f


# memory.LOSS_BYTES_PER_LOGIT's unfused 14 B per logit holds the bf16 logits to the end (as
# torchtitan's reserved memory shows them). The eager stack's model returns the loss alone: the bf16
# logits (2 B) and their fp32 copy die with the forward (the head's GEMM saves its input, the cast
# and log-softmax their outputs only), so backward's first step holds 12 B (the fp32 log-softmax,
# its gradient, the input gradient) and the forward's cross-entropy 2 + 4 + 4 = 10.
LOGITS_FREED_BYTES = 2.0
# Without FSDP the eager stack runs bf16 under autocast (dtrain.train.trainer: FSDP2's
# MixedPrecisionPolicy casts the parameters itself, else autocast does): the parameters stay fp32,
# so the embedding's output and every residual add are fp32 and each norm saves a 4-byte input
# where memory.activation_bytes_per_layer counts 2 (its "2 LayerNorm inputs 4"): 2 more bytes per
# element for each of a block's two norms, and the final norm's
AUTOCAST_NORM_INPUT_BYTES = 2.0


def eager_peak(
    shape: ModelShape,
    layout: Layout,
    base,
    optimizer: str | None,
    precision: str = "",
    compiled: bool = False,
    flash: bool = True,
    exact: bool = False,
):
    """The trainer's peak bytes per GPU (a ``memory.MemoryBreakdown``): the larger of two
    moments, as PyTorch's allocator sees them with ``zero_grad(set_to_none=True)``:
      end of forward  fp32 parameters and Adam's m, v (FSDP2's shares, ``fsdp2_state_bytes``), the
                      bf16 copies the forward runs on (autocast's, 2 B per linear weight, but for
                      the linears torchao's float8 casts from fp32 itself; ZeRO-2: the unsharded
                      parameters counted there; ZeRO-3: the gathered units, ``base.buffers``), the
                      activations, and the gradients only from the second micro-batch on (the
                      first forward has none)
      optimizer step  parameters, gradients, m, v and, for foreach AdamW, its one full-size
                      temporary (the second moment's square root, 4 B per parameter)
    ``base``: ``memory.memory_per_gpu`` of the layout (its activations and ZeRO-3 buffers).
    ``precision`` ("bf16", "fp8"; "" where not ``traced_layer``: the eager stack's own count,
    Korthikanti's plus the fp32 norm inputs) and ``compiled`` choose the block's saved tensors
    under autocast (``autocast_layer_bytes``); ``exact``: the activations are a count of tensors
    (``counted_block``), without ``activations.py``'s 5% for temporaries."""
    psi = params_per_gpu(shape, layout.tp, layout.pp, layout.pp_split)
    p, g, o = fsdp2_state_bytes(psi, layout.zero_stage, layout.shard_group)
    # FSDP (ZeRO-3) casts per unit and frees the unit after its forward, on one GPU too: the
    # block being computed, the one prefetched and the former's gradients (memory_per_gpu's count)
    sharded = layout.zero_stage == 3
    layers = stage_layers(shape, layout.pp, layout.pp_split)
    # ZeRO-2 (FSDP without resharding): the unsharded copy fsdp2_state_bytes counts is the cast
    casts = 0.0 if layout.zero_stage >= 2 else 2 * linear_params(shape, layout)
    if casts and precision == "fp8":  # Float8Linear keeps no bf16 weight: the head's cast only
        casts -= 2 * layers * shape.param_count.matmul_per_layer / layout.tp
    units = (base.buffers or 3 * 2 * shape.params_per_layer() / layout.tp) if sharded else 0.0
    held = g if layout.grad_accum > 1 else 0.0
    # the last stage's logits (memory.activation_bytes' count, its 5% of temporaries included)
    logits = layout.micro_batch * shape.seq_len * shape.vocab / layout.tp
    acts = max(0.0, base.activations - 1.05 * LOGITS_FREED_BYTES * logits)
    if layout.zero_stage < 2:  # autocast: fp32 residual stream
        tokens = layout.micro_batch * shape.seq_len // layout.cp
        if precision:  # the block's own count in place of Korthikanti's
            counted = layer_activation_bytes(shape, layout, flash) / tokens
            own = autocast_layer_bytes(shape, layout, compiled, precision)
            acts += 1.05 * tokens * layers * (own - counted)
            acts += 1.05 * AUTOCAST_NORM_INPUT_BYTES * tokens * shape.d_model  # the final norm
        else:
            acts += 1.05 * AUTOCAST_NORM_INPUT_BYTES * tokens * shape.d_model * (2 * layers + 1)
    if exact:  # the step peaks at the count (``dtrain.gpucheck.saved_tensors --peak``)
        acts /= 1.05
    forward = MemoryBreakdown(p + casts, held, o, acts, units)
    shard = psi / layout.shard_group if layout.zero_stage >= 1 else psi
    temp = 0.0 if optimizer == "fused" else 4 * shard
    step = MemoryBreakdown(p, g, o + temp, 0.0)
    return forward if forward.total >= step.total else step
