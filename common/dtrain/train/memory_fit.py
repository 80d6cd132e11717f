"""Does a training run fit here? Refuse, before any rank starts, a model the project's own memory
model (dtrain.costmodel.memory) says cannot fit, instead of ranks killed by the OOM killer.

Local runs only (on Slurm the compute nodes' memory is not known here). On CPU every rank of the
run shares this host's RAM: need = ranks x bytes per rank, against MemAvailable. On GPUs each rank
has its own device: need = bytes per rank, against the device's total memory. The estimate counts
weights, gradients, Adam state as this trainer keeps them (`fsdp2_state_bytes`: 16 bytes per
parameter, sharded by strategy), activations and logits (the cost model's formulas); not the
process itself, allocator slack or communication buffers, so it errs towards letting a run start.
It only refuses when the estimate exceeds everything available.

Layouts (train.tp, train.pp): "per rank" is the busiest rank. Its parameters are counted from the
trainer's own split (`params_per_rank`): the pipeline stages this rank holds (dtrain.parallel.
pipeline), block matrices / tp, norms, row-parallel biases, embeddings and lm_head whole on every
tp rank (they are not vocab-parallel), wk/wv whole when kv_heads < tp. States are sharded over
the dp ranks that shard (dp / hsdp_replicate); with pp > 1, FSDP2 keeps parameters gathered
through the step (zero2, as dtrain.train.parallelize does; `dtrain.core.layout.zero_stage_of`).
Activations are the cost model's (Korthikanti et al. per layer / tp, 1F1B in-flight micro-batches,
interleaving), with the logits
of a replicated lm_head (each tp rank computes all V of them) and, with kv_heads < tp, the k and
v of the one head each rank computes with.

An MoE model (``model.moe``; the trainer runs it with tp = pp = 1) holds its non-expert weights
sharded as a dense model's and, of each MoE layer, E/ep experts sharded over efsdp
(``dtrain.parallel.ep.trainer_ep``); its activations are its dense proxy's (every MLP the width a
token meets) plus the routed rows, the experts (``expert_params_per_gpu``) and the routed
activations (``routed_activation_bytes``) as the cost model's ``moe_memory.moe_memory`` counts them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

from dtrain.core.errors import UserError
from dtrain.costmodel.gpt_shape import moe_model_of, shape_of
from dtrain.costmodel.memory import MemoryBreakdown, memory_per_gpu
from dtrain.costmodel.model_states import fsdp2_state_bytes
from dtrain.costmodel.moe_memory import moe_memory
from dtrain.model.args import GPTConfig, num_params
from dtrain.parallel.pipeline import split_layers, stages_of_rank

GiB = 2**30


@dataclass(frozen=True)
class Need:
    per_rank: float  # bytes one rank holds at its peak
    states: float  # of which weights + grads + optimizer
    activations: float  # of which activations + logits (+ ZeRO-3 gathered layers)
    init: float  # a rank builds the whole fp32 model before sharding it


def params_per_rank(
    model: GPTConfig, tp: int = 1, pp: int = 1, schedule: str = "1f1b", virtual: int = 1
) -> int:
    """Parameters the busiest rank of the trainer's tp x pp layout holds (num_params(model) on
    one rank)."""
    d, hidden, kv = model.d_model, model.mlp_hidden, model.kv_dim
    norm = d * (2 if model.norm == "layernorm" and model.bias else 1)
    kv_split = (
        tp if model.n_kv_head >= tp else 1
    )  # fewer k/v heads than ranks: wk, wv whole everywhere
    block = 2 * norm + 2 * d * (d // tp) + 2 * d * (hidden // tp) + 2 * d * (kv // kv_split)
    if model.bias:  # column-parallel biases are split; row-parallel ones (wo, w2) are whole
        block += d // tp + 2 * (kv // kv_split) + hidden // tp + 2 * d
    stages = pp * virtual if pp > 1 else 1
    ranges = split_layers(model.n_layer, stages)
    first = (model.vocab_size + model.seq_len) * d
    last = norm + (0 if model.tie_embeddings else d * model.vocab_size)

    def held(pp_rank: int) -> int:
        indices = stages_of_rank(pp_rank, pp, schedule, virtual) if pp > 1 else [0]
        return sum(
            block * len(ranges[s]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
            for s in indices
        )

    return max(held(r) for r in range(pp))


def training_need(model: GPTConfig, train, world_size: int) -> Need:
    """Peak bytes on the busiest rank of dtrain's Trainer for this model, layout, strategy and batch
    (`train`: a resolved TrainConfig, grad_accum derived)."""
    run = train.layout(world_size)
    tp, pp = run.tp, run.pp
    # One rank's view for the memory formulas: its states sharded over the ranks that shard them
    # (dp_shard, and the cp ranks too under FSDP2: dtrain.train.parallelize; 1 for ddp), one
    # replica group, a cp rank's seq_len / cp tokens in `shape` below; priced as 1F1B (interleaved
    # with pp_virtual > 1) whatever the schedule, as this check always has.
    shards = run.dp_shard * (run.cp if train.sharded else 1)
    layout = replace(run, dp_replicate=1, dp_shard=shards, cp=1, cp_impl="ring", pp_schedule="1f1b")
    # The formulas assume 16-bit activations; an fp32 run keeps them in 4 bytes.
    factor = 2.0 if train.precision != "bf16" else 1.0  # auto: as fp32 (the larger)
    # The cost model's head is vocab-parallel (V/tp logits per rank); the trainer's computes all V
    # on every tp rank, which is that formula with tp*V entries (vocab enters the activations only
    # there). With kv_heads < tp each rank stores k and v of one head, as if there were tp of them.
    moe = moe_model_of(model) if model.moe is not None else None
    shape = replace(
        moe.proxy if moe else shape_of(model),
        vocab=model.vocab_size * tp,
        n_kv_head=max(model.n_kv_head, tp),
        seq_len=model.seq_len // run.cp,
    )
    # dtrain's GPT: SDPA attention, its loss PyTorch's unfused F.cross_entropy
    m = memory_per_gpu(
        shape, layout, activation_bytes_factor=factor, flash_attention=True, fused_loss=False
    )
    psi = params_per_rank(model, tp, pp, train.pp_schedule, train.pp_virtual)
    routed = 0.0
    if moe is not None:
        experts, routed = moe_need(moe, layout, factor)
        psi = num_params(model) - moe.moe_layers * moe.expert_params()  # all but the experts
        states = sum(fsdp2_state_bytes(psi, layout.zero_stage, shards))
        states += sum(fsdp2_state_bytes(experts, layout.zero_stage, layout.efsdp))
    else:
        states = sum(fsdp2_state_bytes(psi, layout.zero_stage, shards))
    # the trainer's states, not Megatron's
    m = replace(m, params=states, grads=0.0, optimizer=0.0, activations=m.activations + routed)
    init = 4.0 * num_params(model)  # every rank builds the whole model before splitting it
    return Need(max(m.total, init), states, m.activations + m.buffers, init)


def moe_need(moe, layout, activation_factor: float) -> tuple[float, float]:
    """(expert weights the busiest rank holds, its routed activation bytes): the cost model's MoE
    memory terms (``moe_memory.moe_memory``) at ``layout``."""
    empty = MemoryBreakdown(params=0.0, grads=0.0, optimizer=0.0, activations=0.0)
    _, terms = moe_memory(moe, layout, empty, activation_factor=activation_factor)
    return terms["expert_params_per_gpu"], terms["routed_activation_bytes"]


def available_host_bytes() -> float:
    with contextlib.suppress(OSError):  # no /proc (not Linux): fall back to sysconf
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_fits(
    model: GPTConfig, train, world_size: int, device: torch.device, what: str = "the model"
) -> None:
    """UserError with the numbers when the run cannot fit on this host."""
    need = training_need(model, train, world_size)
    if device.type == "cuda":
        have = float(torch.cuda.get_device_properties(device.index or 0).total_memory)
        total, where = need.per_rank, f"per GPU ({torch.cuda.get_device_name(device.index or 0)})"
    else:
        have = available_host_bytes()
        total, where = need.per_rank * world_size, f"of host memory for {world_size} rank(s)"
    if total <= have:
        return
    dims = train.dims(world_size)
    layout = f", busiest of {dims.describe}" if dims.model_parallel else ""
    raise UserError(
        f"{what} cannot fit: it needs about {total / GiB:.1f} GiB {where} but {have / GiB:.1f} "
        f"GiB is available (per rank{layout}: weights+grads+Adam {need.states / GiB:.1f} GiB, "
        f"activations {need.activations / GiB:.1f} GiB, whole fp32 model at build "
        f"{need.init / GiB:.1f} GiB; dtrain.costmodel.memory): pick a smaller model.preset, lower "
        "train.micro_batch or model.seq_len, fewer ranks, or launcher=slurm on bigger nodes"
    )
