"""Does a training run fit here? Refuse, before any rank starts, a model the project's own memory
model (dtrain.costmodel.memory) says cannot fit, instead of ranks killed by the OOM killer.

Local runs only (on Slurm the compute nodes' memory is not known here). On CPU every rank of the
run shares this host's RAM: need = ranks x bytes per rank, against MemAvailable. On GPUs each rank
has its own device: need = bytes per rank, against the device's total memory. The estimate counts
weights, gradients, Adam state as this trainer keeps them (`fsdp2_state_bytes`: 16 bytes per
parameter, sharded by strategy), activations and logits (the cost model's formulas); not the
process itself, allocator slack or communication buffers, so it errs towards letting a run start.
It only refuses when the estimate exceeds everything available.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

from dtrain.costmodel.memory import Layout, ModelShape, fsdp2_state_bytes, memory_per_gpu, params_per_gpu
from dtrain.errors import UserError
from dtrain.model import GPTConfig, num_params
from dtrain.strategies import ZERO_STAGE

GiB = 2**30


def shape_of(g: GPTConfig) -> ModelShape:
    """dtrain's GPT in the cost model's terms (GELU MLP, learned positions counted as tiny)."""
    return ModelShape(g.n_layer, g.d_model, g.n_head, g.n_kv_head, g.vocab_size, g.seq_len, float(g.mlp_ratio),
                      False, g.tie_embeddings, name="run")


@dataclass(frozen=True)
class Need:
    per_rank: float      # bytes one rank holds at its peak
    states: float        # of which weights + grads + optimizer
    activations: float   # of which activations + logits (+ ZeRO-3 gathered layers)
    init: float          # a rank builds the whole fp32 model before sharding it


def training_need(model: GPTConfig, train, world_size: int) -> Need:
    """Peak bytes per rank of dtrain's Trainer for this model, strategy and batch."""
    strategy = train.strategy
    dp = world_size // train.hsdp_replicate if strategy == "hsdp" else world_size
    recompute = "full" if train.activation_checkpointing == "block" else "none"
    layout = Layout(dp=max(dp, 1), tp=1, pp=1, zero_stage=ZERO_STAGE.get(strategy, 3) if world_size > 1 else 0,
                    recompute=recompute, micro_batch=train.micro_batch, grad_accum=train.grad_accum)
    # The formulas assume 16-bit activations; an fp32 run keeps them in 4 bytes.
    factor = 2.0 if train.precision != "bf16" else 1.0  # auto: as fp32 (the larger)
    shape = shape_of(model)
    m = memory_per_gpu(shape, layout, activation_bytes_factor=factor, flash_attention=True)
    states = sum(fsdp2_state_bytes(params_per_gpu(shape, 1, 1), layout.zero_stage, layout.dp))
    m = replace(m, params=states, grads=0.0, optimizer=0.0)  # the trainer's states, not Megatron's
    init = 4.0 * num_params(model)
    return Need(max(m.total, init), states, m.activations + m.buffers, init)


def available_host_bytes() -> float:
    with contextlib.suppress(OSError):  # no /proc (not Linux): fall back to sysconf
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_fits(model: GPTConfig, train, world_size: int, device: torch.device, what: str = "the model") -> None:
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
    raise UserError(
        f"{what} cannot fit: it needs about {total / GiB:.1f} GiB {where} but {have / GiB:.1f} GiB is available "
        f"(per rank: weights+grads+Adam {need.states / GiB:.1f} GiB, activations {need.activations / GiB:.1f} GiB, "
        f"whole fp32 model at build {need.init / GiB:.1f} GiB; dtrain.costmodel.memory): pick a smaller "
        "model.preset, lower train.micro_batch or model.seq_len, fewer ranks, or launcher=slurm on bigger nodes")
