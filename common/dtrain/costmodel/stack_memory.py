"""Peak memory per GPU on a software stack: ``memory.memory_per_gpu`` with the stack's fields that
move memory, and the eager FSDP stack's own peak (``eager_peak``). Apart from memory.py so that
the eager stack's terms (eager.py) and the memory model import neither each other."""

from __future__ import annotations

from .eager import linear_params
from .memory import MemoryBreakdown, memory_per_gpu
from .model_states import fsdp2_state_bytes, params_per_gpu
from .shapes import Layout, ModelShape, stage_layers
from .stack import Stack


def memory_for(
    shape: ModelShape, layout: Layout, stack: Stack, activation_bytes_factor: float = 1.0
) -> MemoryBreakdown:
    """``memory_per_gpu`` on ``stack``: the one place that knows which of its fields move memory
    (the attention kernel, the loss, the gradient and optimizer-state dtypes); the eager FSDP
    stack's peak is ``eager_peak``'s."""
    base = memory_per_gpu(
        shape,
        layout,
        activation_bytes_factor,
        stack.flash,
        stack.fused_loss,
        stack.grad_bytes,
        stack.optimizer_states,
    )
    if stack.software != "fsdp-eager":
        return base
    return eager_peak(shape, layout, base, stack.optimizer)


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


def eager_peak(shape: ModelShape, layout: Layout, base, optimizer: str | None):
    """The eager stack's peak bytes per GPU (a ``memory.MemoryBreakdown``): the larger of two
    moments, as PyTorch's allocator sees them with ``zero_grad(set_to_none=True)``:
      end of forward  fp32 parameters and Adam's m, v (FSDP2's shares, ``fsdp2_state_bytes``), the
                      bf16 copies the forward runs on (autocast's, 2 B per linear weight; ZeRO-2:
                      the unsharded parameters counted there; ZeRO-3: the gathered units,
                      ``base.buffers``), the activations, and the gradients only
                      from the second micro-batch on (the first forward has none)
      optimizer step  parameters, gradients, m, v and, for foreach AdamW, its one full-size
                      temporary (the second moment's square root, 4 B per parameter)
    ``base``: ``memory.memory_per_gpu`` of the layout (its activations and ZeRO-3 buffers)."""
    psi = params_per_gpu(shape, layout.tp, layout.pp, layout.pp_split)
    p, g, o = fsdp2_state_bytes(psi, layout.zero_stage, layout.shard_group)
    # FSDP (ZeRO-3) casts per unit and frees the unit after its forward, on one GPU too: the
    # block being computed, the one prefetched and the former's gradients (memory_per_gpu's count)
    sharded = layout.zero_stage == 3
    # ZeRO-2 (FSDP without resharding): the unsharded copy fsdp2_state_bytes counts is the cast
    casts = 0.0 if layout.zero_stage >= 2 else 2 * linear_params(shape, layout)
    units = (base.buffers or 3 * 2 * shape.params_per_layer() / layout.tp) if sharded else 0.0
    held = g if layout.grad_accum > 1 else 0.0
    # the last stage's logits (memory.activation_bytes' count, its 5% of temporaries included)
    logits = layout.micro_batch * shape.seq_len * shape.vocab / layout.tp
    acts = max(0.0, base.activations - 1.05 * LOGITS_FREED_BYTES * logits)
    if layout.zero_stage < 2:  # autocast: fp32 residual stream
        layers = stage_layers(shape, layout.pp, layout.pp_split)
        tokens = layout.micro_batch * shape.seq_len
        acts += 1.05 * AUTOCAST_NORM_INPUT_BYTES * tokens * shape.d_model * (2 * layers + 1)
    forward = MemoryBreakdown(p + casts, held, o, acts, units)
    shard = psi / layout.shard_group if layout.zero_stage >= 1 else psi
    temp = 0.0 if optimizer == "fused" else 4 * shard
    step = MemoryBreakdown(p, g, o + temp, 0.0)
    return forward if forward.total >= step.total else step
