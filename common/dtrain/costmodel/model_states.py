"""Model states per GPU: the parameters on the most loaded GPU and their ZeRO bytes.

Sources
-------
* Model states: Megatron-LM ``megatron/training/theoretical_memory_usage.py``
  (``compute_weight_and_optimizer_memory``): mixed-precision Adam keeps 18 bytes per parameter,
  bf16 weights 2 + fp32 main gradients 4 + fp32 master weights, momentum and variance 4+4+4;
  6 + 12/d with the distributed optimizer (= ZeRO-1). ZeRO stages after Rajbhandari et al. 2020
  (SC'20) §5 as FSDP2 holds them (stage 2: 2Ψ + 16Ψ/N, stage 3: 16Ψ/N; see ``model_state_bytes``).

Biases are not counted (small next to the terms kept).
"""

from __future__ import annotations

from functools import lru_cache

from .shapes import ModelShape, stage_layers


def model_state_bytes(
    psi: float, zero_stage: int, dp: int, grad_bytes: int = 4, optimizer_states: str = "fp32"
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for Ψ = ``psi`` parameters on this GPU's shard, N =
    ``dp``.

    Mixed-precision AdamW as the stacks that use each stage hold it:
      stage 0 (plain DP, Megatron):              2Ψ bf16 + 4Ψ fp32 main grads + 12Ψ fp32 master, m,
                                                 v = 18Ψ
      stage 1 (Megatron distributed optimizer):  2Ψ + 4Ψ + 12Ψ/N                     = 6Ψ + 12Ψ/N
        (both: Megatron-LM ``theoretical_memory_usage.py``, 18 and 6 + 12/dp bytes per parameter)
      stage 2 (bf16 weights replicated):         2Ψ + 4Ψ/N fp32 grads + 12Ψ/N         = 2Ψ + 16Ψ/N
      stage 3 (FSDP2 full sharding):             (4 fp32 params + 4 fp32 grads + 8 m, v)Ψ/N = 16Ψ/N
    FSDP2 keeps the fp32 sharded parameters as the master copy (MixedPrecisionPolicy casts a bf16
    copy per unit for compute) and reduces gradients in fp32 (torchtitan's default), so a fully
    sharded parameter costs 16 bytes, not DeepSpeed's 2 + 2 + 12 + 4 (fp32 gradient partition). Its
    gathered bf16 working set is ``MemoryBreakdown.buffers``.

    ``grad_bytes`` 2 (``Stack.grad_reduce`` "bf16"): the stage 0-2 gradient buffers in bf16 (FSDP2's
    reduced shard takes its fp32 parameter's dtype: stage 3 keeps 4). ``optimizer_states`` "bf16":
    the Adam moments in bf16 and no fp32 master copy, the bf16 weights updated in place (apex
    DistributedFusedAdam with ``dtype`` bf16, as NeMo runs it with ``store_params=False``): 4Ψ of
    optimizer state, sharded as the stage shards it; at stage 3 the sharded parameters and their
    gradients are then bf16 too (2 + 2 + 4)Ψ/N.
    """
    nd, g = dp, grad_bytes
    fp32 = optimizer_states == "fp32"
    master, moments = (4, 8) if fp32 else (0, 4)  # fp32 master copy + Adam's m and v
    if zero_stage == 0:
        return 2 * psi, g * psi, (master + moments) * psi
    if zero_stage == 1:
        return 2 * psi, g * psi, (master + moments) * psi / nd
    if zero_stage == 2:
        return 2 * psi, g * psi / nd, (master + moments) * psi / nd
    if (
        zero_stage == 3
    ):  # the sharded parameters are the master copy, their gradients in the same dtype
        shard = 4 if fp32 else 2
        return shard * psi / nd, shard * psi / nd, moments * psi / nd
    raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")


def fsdp2_state_bytes(psi: float, zero_stage: int, dp: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank of dtrain's own trainer (FSDP2 / DDP, fp32 Adam).

    FSDP2 keeps the fp32 parameters themselves as the master copy (MixedPrecisionPolicy casts a
    transient bf16 copy per block for compute) and reduces gradients in fp32, so a parameter costs
    4 + 4 + 8 = 16 bytes, not Megatron's 18 (ZeRO paper §5 with K = 8 and fp32 weights):
      stage 0 (DDP): 16Ψ;  stage 2: 4Ψ + 12Ψ/N;  stage 3: 16Ψ/N.
    """
    if zero_stage == 0:
        return 4 * psi, 4 * psi, 8 * psi
    if zero_stage in (1, 2):
        return 4 * psi, 4 * psi / dp if zero_stage == 2 else 4 * psi, 8 * psi / dp
    if zero_stage == 3:
        return 4 * psi / dp, 4 * psi / dp, 8 * psi / dp
    raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")


@lru_cache(maxsize=1 << 12)
def params_per_gpu(shape: ModelShape, tp: int, pp: int, split: str = "layers") -> float:
    """Parameters on the most loaded GPU: ceil(L/pp) layers / tp plus embeddings / tp.

    The vocab-parallel embedding and output projection are split over TP (Megatron); with pp > 1
    the input embedding sits on the first stage and the output projection on the last (a tied
    embedding is held by both), so a stage holds at most one V·h matrix; with pp = 1 it holds
    both. Norm weights (replicated under TP in Megatron) are divided too: negligible. With
    tp > n_kv_head each rank keeps one whole K and V head (replicated), as Megatron and dtrain do.
    ``split`` "balanced" (``shapes.PP_SPLITS``): the larger of a middle stage's layers and an end
    stage's one layer fewer plus its V·h matrix.
    """
    layer = shape.params_per_layer_on_rank(tp)
    layers = stage_layers(shape, pp, split)
    if split == "balanced" and pp > 2:
        return max(layers * layer, (layers - 1) * layer + embedding_params_per_gpu(shape, tp, pp))
    return layers * layer + embedding_params_per_gpu(shape, tp, pp)


def embedding_params_per_gpu(shape: ModelShape, tp: int, pp: int) -> float:
    """The V·h embedding / output matrices among ``params_per_gpu``: the parameters FP8 recipes
    keep in bf16 (torchtitan converts every block linear but not the output projection; an
    embedding is no linear)."""
    matrices = (1 if shape.tied_embeddings else 2) if pp == 1 else 1
    return matrices * shape.vocab * shape.d_model / tp
