"""Apply a layout to a GPT: `parallelize`, the one path for every layout (dtrain.parallel.mesh's
ParallelDims, tp = pp = 1 included), in torchtitan's order: pipeline split, tensor parallelism
(`train.tp_impl`: the hand-rolled Megatron layers or the DTensor plan), context parallelism
(`train.cp`: the attention core, dtrain.parallel.cp), expert parallelism (`train.ep`: the MoE
layers' experts and dispatch, dtrain.parallel.ep), activation checkpointing, compile, data
parallelism (over dp x cp: cp ranks hold gradients of different tokens; the experts over efsdp).

Data-parallel strategies:
    single  the model on this rank's device
    ddp     full replica per rank, gradients all-reduced (DistributedDataParallel when tp = pp = 1)
    zero2   FSDP2 fully_shard per block then the root, reshard_after_forward=False: parameters
            stay gathered from forward until backward (no second all-gather), grads + optimizer
            state sharded
    zero3   the same with reshard_after_forward=True: parameters freed after each block's forward
            and all-gathered again in backward
    hsdp    zero3 on a 2-D mesh (replicate x shard): sharded within a group, replicated across
            groups (gradients reduce-scattered inside a group, all-reduced across groups)

The model must arrive on CPU; FSDP2 moves only each rank's shard to the mesh's device.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from dtrain.parallel.mesh import ParallelDims
from dtrain.train.config import TrainConfig


def _op_policy_context():
    """Selective op AC (torchtitan ``selective_ac_option="op"``): in each checkpointed block keep
    the outputs of SDPA and of every other matmul (1st, 3rd, ... in forward order: wq, wv, w1 of
    a GELU block), recompute the rest in backward (wk, wo, w2 and the element-wise ops). A fresh
    count per block call, one for the forward and one for the recompute, so both see the same
    numbering."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {
        aten.mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        keep.add(aten._scaled_dot_product_cudnn_attention.default)
    counts = {False: 0, True: 0}  # matmuls seen, forward / recompute

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str = "block") -> None:
    """Recompute in backward instead of keeping: each block's whole activations (``block``), or
    those the selective op policy does not save (``op``, ``_op_policy_context``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    extra = {"context_fn": _op_policy_context} if mode == "op" else {}
    for name, block in list(
        model.blocks.named_children()
    ):  # a GPT's ModuleList or a stage's ModuleDict
        # no dropout: no RNG to replay
        setattr(model.blocks, name, checkpoint_wrapper(block, preserve_rng_state=False, **extra))


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (nn.Module.compile: module names and state-dict keys stay
    the same, so checkpoints, hooks and the precision map see the same model). Per block, as in
    torchtitan: the blocks are alike, so they share compiled code, and FSDP2's per-block hooks stay
    outside the compiled regions."""
    for block in model.blocks.children():  # a GPT's ModuleList or a pipeline stage's ModuleDict
        block.compile()


def mixed_precision_policy(train: TrainConfig):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if train.precision == "bf16":  # bf16 compute and all-gather, fp32 gradient reduction
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    model: nn.Module, train: TrainConfig, mesh, device: torch.device, efsdp_mesh=None
) -> None:
    """FSDP2 per block, then the root; with expert parallelism (``efsdp_mesh``) each MoE layer's
    experts first, over the efsdp ranks (dtrain.parallel.ep.trainer_ep.shard_experts)."""
    from torch.distributed.fsdp import fully_shard

    reshard = train.strategy != "zero2"
    policy = mixed_precision_policy(train)
    if efsdp_mesh is not None:
        from dtrain.parallel.ep.trainer_ep import shard_experts

        shard_experts(model, efsdp_mesh, policy, reshard)
    blocks = list(model.blocks.children())  # a GPT's ModuleList or a pipeline stage's ModuleDict
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first thing in backward: keep them
        # (torchtitan).
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard and i < len(blocks) - 1,
        )
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    if train.prefetch:
        set_explicit_prefetch(model, blocks)
        if device.type == "cpu" and hasattr(model, "_set_unshard_async_op"):
            # CPU has no side streams, so FSDP2's default unshard (async_op=False) blocks until the
            # all-gather is done, prefetched or not. Async unshards return at once; the wait moves
            # to the block's pre-forward. (Private FSDPModule method, documented, torch >= 2.5.)
            model._set_unshard_async_op(True)


def set_explicit_prefetch(root: nn.Module, blocks: list[nn.Module]) -> None:
    """Issue block i+1's all-gather when block i starts forward (i-1's when i starts backward).

    Without this, on CPU each unshard is issued only when its block runs and waited on at once,
    so communication never overlaps compute; on GPU FSDP2 already prefetches one block implicitly
    and this makes it explicit (and deterministic)."""
    if blocks:
        root.set_modules_to_forward_prefetch([blocks[0]])
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def apply_ddp(model: nn.Module, dims: ParallelDims, device: torch.device) -> nn.Module:
    """DistributedDataParallel over the replicas (replicate x cp): bucketed all-reduces
    overlapped with backward."""
    from torch.nn.parallel import DistributedDataParallel

    group = dims.replica_group()
    return DistributedDataParallel(
        model.to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
    )


def apply_tp(
    part: nn.Module, train: TrainConfig, dims: ParallelDims, n_layer: int
) -> dict[str, tuple]:
    """Tensor parallelism on one part, hand-rolled or DTensor (`train.tp_impl`); returns the
    parameters whose gradients are partial sums over tp (name -> (group, rows))."""
    if dims.tp == 1:
        return {}
    from dtrain.parallel.ep.moe_tp import split_tokens_over_tp

    tp_mesh = dims.submesh("tp")
    if train.tp_impl == "dtensor":
        from dtrain.parallel.tp.dtensor_plan import apply_dtensor_tp

        partial = apply_dtensor_tp(part, tp_mesh, train.sequence_parallel, n_layer)
    else:
        from dtrain.parallel.tp.megatron import apply_megatron_tp

        partial = apply_megatron_tp(
            part, tp_mesh, train.sequence_parallel, n_layer, train.async_grad_allreduce
        )
    # MoE layers: each tp rank routes its share of the tokens (expert TP 1)
    moe = split_tokens_over_tp(part, tp_mesh.get_group(), train.sequence_parallel, dims.ep)
    return {**partial, **moe}


def apply_cp(
    part: nn.Module, train: TrainConfig, dims: ParallelDims, device: torch.device
) -> str | None:
    """Context parallelism on one part: the implementation this run uses (None without cp)."""
    if dims.cp == 1:
        return None
    import torch.distributed as dist

    from dtrain.parallel.cp.trainer_cp import select_impl, swap_attention_cores

    impl = select_impl(train.cp_impl, device.type, dist.get_backend())
    swap_attention_cores(part, impl, dims.submesh("cp"))
    return impl


def apply_ep(part: nn.Module, dims: ParallelDims, device: torch.device):
    """Expert parallelism on one part: its experts sliced over the ep ranks, the all-to-all
    dispatch; returns the efsdp mesh FSDP2 shards the experts over (None without ep)."""
    if dims.ep == 1:
        return None
    from dtrain.parallel.ep.trainer_ep import apply_expert_parallel

    mesh = dims.build_expert_mesh(device.type)
    apply_expert_parallel(part, mesh["ep"])
    return mesh["efsdp"]


def parallelize(gpt: nn.Module, train: TrainConfig, dims: ParallelDims, device: torch.device):
    """Every layout's one path (torchtitan's order): pipeline split, then per part tensor
    parallelism -> context parallelism -> activation checkpointing -> compile -> data
    parallelism. Returns the ParallelModel the training loop drives.

    Data parallelism: FSDP2 for the sharded strategies over the (replicate, shard) mesh (and on a
    single rank, so zero3 there measures FSDP2's own cost); with pp > 1 parameters stay gathered
    from forward to backward (as zero2). Replication (ddp, or hsdp with one rank per shard group)
    is DistributedDataParallel when the model is whole; DDP takes no DTensor parameters, so with
    tp or pp > 1 the ParallelModel all-reduces the gradients itself after backward."""
    from dtrain.parallel import pipeline
    from dtrain.train.parallel_model import ParallelModel

    fsdp = train.sharded and (dims.dp_shard * dims.cp > 1 or dims.world_size == 1)
    replicate = not fsdp and dims.dp_replicate * dims.cp > 1
    dims.build_mesh(device.type, one_rank=fsdp)
    pp_rank = dims.coordinate("pp")
    staged = (
        pipeline.split_model(gpt, dims.pp, pp_rank, train.pp_schedule, train.pp_virtual)
        if dims.pp > 1
        else [(0, gpt)]
    )
    # With pp, parameters stay gathered from forward to backward (torchtitan's default): a stage
    # runs many micro-batches per step, and the zero-bubble schedules' weight-gradient pass runs
    # outside FSDP's backward hooks, so it needs them still unsharded.
    fsdp_train = dataclasses.replace(train, strategy="zero2") if dims.pp > 1 else train
    parts, partial, cp_impl = [], [], None
    for _, part in staged:
        partial.append(apply_tp(part, train, dims, gpt.cfg.n_layer))
        cp_impl = apply_cp(part, train, dims, device)
        efsdp_mesh = apply_ep(part, dims, device)
        if train.activation_checkpointing != "none":
            apply_activation_checkpointing(part, train.activation_checkpointing)
        if train.compile:
            apply_compile(part)
        if fsdp:
            apply_fsdp(part, fsdp_train, dims.dp_mesh(), device, efsdp_mesh)
        elif replicate and not dims.model_parallel:
            part = apply_ddp(part, dims, device)
        else:
            part.to(device)
        parts.append(part)
    staged = [(index, part) for (index, _), part in zip(staged, parts)]
    return ParallelModel(
        staged,
        partial,
        train,
        dims,
        device,
        fsdp=fsdp,
        all_reduce_grads=replicate and dims.model_parallel,
        cp_impl=cp_impl,
        seq_len=gpt.cfg.seq_len,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 modifies the module in place, nothing to unwrap)."""
    return getattr(model, "module", model)
