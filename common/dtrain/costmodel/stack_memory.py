"""Peak memory per GPU on a software stack: ``memory.memory_per_gpu`` with the stack's fields that
move memory, and the eager FSDP stack's own peak (``eager_peak``). Apart from memory.py so that
the eager stack's terms (eager.py) and the memory model import neither each other."""

from __future__ import annotations

from .eager import linear_params
from .memory import MemoryBreakdown, fsdp2_state_bytes, memory_per_gpu, params_per_gpu
from .shapes import Layout, ModelShape
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
    forward = MemoryBreakdown(p + casts, held, o, base.activations, units)
    shard = psi / layout.shard_group if layout.zero_stage >= 1 else psi
    temp = 0.0 if optimizer == "fused" else 4 * shard
    step = MemoryBreakdown(p, g, o + temp, 0.0)
    return forward if forward.total >= step.total else step
