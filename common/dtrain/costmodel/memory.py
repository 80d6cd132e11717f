"""Bytes per GPU of a transformer training step: model states (``model_states``), activations
(``activations``) and the ZeRO-3 working buffers, summed in ``MemoryBreakdown``.

Approximations (documented, small next to the terms kept): biases, CUDA context, NCCL buffers
and allocator fragmentation are not counted (the search keeps a headroom fraction of HBM free for
them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .activations import activation_bytes
from .model_states import model_state_bytes, params_per_gpu
from .shapes import Layout, ModelShape


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU. ``buffers``: ZeRO-3 gathered-layer working set; ``total`` is the sum."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float = 0.0
    total: float = field(init=False)

    def __post_init__(self) -> None:
        total = self.params + self.grads + self.optimizer + self.activations + self.buffers
        object.__setattr__(self, "total", total)

    def fits(self, capacity_bytes: float, headroom: float = 0.1) -> bool:
        """True when total ≤ capacity·(1 − headroom)."""
        return self.total <= capacity_bytes * (1.0 - headroom)


def memory_per_gpu(
    shape: ModelShape,
    layout: Layout,
    activation_bytes_factor: float = 1.0,
    flash_attention: bool = True,
    fused_loss: bool = True,
    grad_bytes: int = 4,
    optimizer_states: str = "fp32",
) -> MemoryBreakdown:
    """Model states (ZeRO over dp, Ψ already divided by TP and PP) plus activations.

    ``flash_attention`` (default on, as in every current training stack) drops the stored
    attention scores; pass False for the plain Korthikanti et al. formulas.

    ZeRO-3 / FSDP also holds a working set (``buffers``): the bf16 weights of the block being
    computed and of the one prefetched, plus that block's unsharded bf16 grads before the
    reduce-scatter, 3 · 2 · Ψ_layer bytes (FSDP default: one block per unit, prefetch of one). Under
    PP a stage keeps its weights gathered across the micro-batches and reduces its gradients once,
    at the last (torchtitan: reshard_after_forward off; torch.distributed.pipelining: gradient sync
    on the last micro-batch only): the stage's bf16 weights, 2Ψ, and its unsharded gradients, which
    FSDP2 accumulates between syncs in the reduce dtype
    (``FSDPParam.to_accumulated_grad_if_needed``: fp32 under bf16 mixed precision with fp32
    reduction, torchtitan's default and dtrain's), 4Ψ: 6Ψ (4Ψ with ``grad_bytes`` 2: bf16 reduction
    accumulates in bf16). ZeRO shards over ``shard_group`` (dp·cp, or one HSDP replica group's dp·cp
    / dp_replicate). ``grad_bytes`` and ``optimizer_states``: the gradient and optimizer-state
    dtypes (``model_state_bytes``).
    """
    psi = params_per_gpu(shape, layout.tp, layout.pp, layout.pp_split)
    p, g, o = model_state_bytes(
        psi, layout.zero_stage, layout.shard_group, grad_bytes, optimizer_states
    )
    buffers = 0.0
    if layout.zero_stage == 3 and layout.shard_group > 1:
        buffers = (
            (2 + grad_bytes) * psi
            if layout.pp > 1
            else 3 * 2 * shape.params_per_layer() / layout.tp
        )
    act = activation_bytes(shape, layout, activation_bytes_factor, flash_attention, fused_loss)
    return MemoryBreakdown(params=p, grads=g, optimizer=o, activations=act, buffers=buffers)
