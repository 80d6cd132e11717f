"""Compute time of one training step on the busiest GPU, term by term (``ComputeTerms``).

Each term is work over a rate, the work counted from the model's shape and layout, the rate a
kernel benchmark's share of the datasheet peak (``kernels.yaml`` per GPU, ``KernelModel``):

  gemm       the linear layers' GEMMs: forward, dgrad and wgrad, 2mnk FLOPs each, at
             f(W) = e_max·W/(W + W_half) of the dtype's peak (FP8 runs the blocks' linears in FP8,
             the output projection in BF16, as TransformerEngine and torchao do)
  attention  fused (flash) attention at the benchmark's TFLOP/s for its sequence length and head
             dim: forward 2·2·s²·hd per head, halved by the causal mask, backward 2.5x the forward
             (FlashAttention's count); or, eager, QKᵀ and AV as batched GEMMs plus the softmax
             (and dropout) passes over the stored s x s scores
  memory     the memory-bound kernels (norms, residual adds, RoPE, the MLP activation, dropout,
             FP8 casts) as bytes over HBM bandwidth x the kernel's measured share; `eager`
             (unfused PyTorch) moves EAGER_BYTES times the fused count
  head       output projection (vocab-parallel) and the cross-entropy over its logits
  recompute  what activation checkpointing runs again: a whole forward (full), the attention
             core (selective), or torchtitan's op policy's every-second matmul (op)
  optimizer  AdamW over the rank's shard of the states plus gradient clipping, bytes over HBM (fused
             AdamW with fused kernels, PyTorch's default foreach AdamW in an eager stack)

A device without a kernel table (the local CPU check) is a GEMM-only model: its GEMM curve comes
from the gemm-probe, attention runs as batched GEMMs, and the probe's measured fixed overhead stands
for everything memory-bound (``Calibration.step_overhead_s``).

The rates: ``device_rates.Device`` (on ``kernel_rates``' table); the attention core:
``attention_time``; the memory-bound kernels' bytes: ``memory_bound``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from .attention_time import attention_s
from .device_rates import Device
from .efficiency import head_gemm, layer_gemms, op_recompute_gemms
from .memory_bound import (
    EAGER_FP8_WEIGHT_CAST_BYTES,
    FORWARD_SHARE,
    FP8_GATHERED_WEIGHT_BYTES,
    FP8_SHARD_CAST_BYTES,
    FP8_WEIGHT_CAST_BYTES,
    memory_bytes,
    memory_kind,
    memory_widths,
)
from .shapes import Layout, ModelShape, last_stage_layers, stage_layers

# AdamW per parameter: reads param, grad, m, v and writes param, m, v (fp32): 28 B; clipping reads
# the gradients and scales them: 12 B.
OPTIMIZER_BYTES, CLIP_BYTES = 28.0, 12.0


@dataclass(frozen=True)
class ComputeTerms:
    """Seconds of one step's compute on the busiest GPU, by term (see the module docstring)."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    head: float = 0.0
    recompute: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.gemm + self.attention + self.memory + self.head + self.recompute + self.optimizer
        )

    def times(self, m: int, optimizer: float = 0.0) -> ComputeTerms:
        """m micro-batches of these terms plus one optimizer step."""
        return ComputeTerms(
            self.gemm * m,
            self.attention * m,
            self.memory * m,
            self.head * m,
            self.recompute * m,
            optimizer,
        )

    def scaled(self, f: float) -> ComputeTerms:
        """Every term but the optimizer times ``f``."""
        return ComputeTerms(
            self.gemm * f,
            self.attention * f,
            self.memory * f,
            self.head * f,
            self.recompute * f,
            self.optimizer,
        )

    def as_dict(self) -> dict:
        return {
            k: getattr(self, k)
            for k in ("gemm", "attention", "memory", "head", "recompute", "optimizer")
        }


def layer_terms(
    shape: ModelShape, layout: Layout, dev: Device, precision: str = "bf16", value_bytes: int = 2
) -> ComputeTerms:
    """One layer, one micro-batch: GEMMs, attention, memory-bound kernels and recompute (cached
    on what they depend on: a search times thousands of layouts that share them)."""
    key = Layout(
        cp=layout.cp,
        tp=layout.tp,
        zero_stage=0,
        recompute=layout.recompute,
        micro_batch=layout.micro_batch,
        grad_accum=1,
        sequence_parallel=layout.sequence_parallel,
        cp_impl=layout.cp_impl,
    )
    weight_casts = fp8_weight_casts(dev, precision, layout.zero_stage)
    # the trainer under FSDP computes in bf16 parameters without autocast (BF16_PARAMS_BYTES)
    bf16_params = dev.bf16_params_sharded and layout.zero_stage >= 2
    return _layer_terms(shape, key, dev, precision, value_bytes, weight_casts, bf16_params)


def fp8_weight_casts(dev: Device, precision: str, zero_stage: int) -> str:
    """Where the block weights are cast to FP8: "layer" (dynamic scaling, at each use), "gathered"
    (FSDP, ZeRO 2/3, gathering them in FP8: on the shard before each gather, ``fp8_shard_cast_s``,
    and the backward's transposed copy on the layer) or "" (bf16, or delayed scaling, whose casts
    are TransformerEngine's own)."""
    if precision != "fp8" or dev.fp8_scaling not in ("dynamic", "eager"):
        return ""
    return "gathered" if dev.fp8_weight_gather and zero_stage >= 2 else "layer"


@lru_cache(maxsize=1 << 14)
def _layer_terms(
    shape: ModelShape,
    layout: Layout,
    dev: Device,
    precision: str,
    value_bytes: int,
    weight_casts: str = "",
    bf16_params: bool = False,
) -> ComputeTerms:
    local = replace(
        shape, seq_len=shape.seq_len // layout.cp
    )  # a rank's tokens: s/cp of each sequence
    attention = shape
    shape = local
    gemms = [g for g in layer_gemms(shape, layout) if g.name not in ("scores", "av")]
    dtype = (
        "fp8"
        if precision == "fp8" and "fp8" in dev.kernels.gemm
        else ("bf16" if value_bytes == 2 else "fp32")
    )
    fwd_gemm = sum(dev.gemm_s(g, dtype, value_bytes) for g in gemms)
    attn = attention_s(attention, layout, dev)
    widths = memory_widths(shape, layout, dev.fp8_scaling)
    mem = (
        {
            k: dev.mem_s(v, memory_kind(k, dev.fp8_scaling), widths.get(k))
            for k, v in memory_bytes(
                shape, layout, precision, dev.fused, dev.fp8_scaling, bf16_params
            ).items()
        }
        if dev.kernels.memory
        else {}
    )
    weights = shape.params_per_layer_on_rank(layout.tp)
    if weight_casts == "layer" and mem:
        per_param = (
            EAGER_FP8_WEIGHT_CAST_BYTES if dev.fp8_scaling == "eager" else FP8_WEIGHT_CAST_BYTES
        )
        eager = dev.fp8_scaling == "eager"  # torchao's unfused cast, at its measured rate
        mem["fp8_weight_cast"] = dev.mem_s(
            per_param * weights,
            memory_kind("fp8_cast", dev.fp8_scaling),
            shape.d_model if eager else None,
        )
    elif weight_casts == "gathered" and mem:
        mem["fp8_weight_copy"] = dev.mem_s(FP8_GATHERED_WEIGHT_BYTES * weights, "add")
    rc = 0.0
    if layout.recompute == "full":
        rc = (
            fwd_gemm
            + attention_s(attention, layout, dev, forward_only=True)
            + sum(t * FORWARD_SHARE[k] for k, t in mem.items())
        )
    elif layout.recompute == "selective":  # the attention core again, with its ring's merges
        rc = attention_s(attention, layout, dev, forward_only=True) + mem.get("cp_merge_fwd", 0.0)
    elif layout.recompute == "op":  # SDPA's output is saved: no attention (nor its merges) re-run
        rc = sum(
            dev.gemm_s(g, dtype, value_bytes) for g in op_recompute_gemms(shape, layout)
        ) + sum(t * FORWARD_SHARE[k] for k, t in mem.items() if k not in ("add", "cp_merge_fwd"))
    return ComputeTerms(gemm=3 * fwd_gemm, attention=attn, memory=sum(mem.values()), recompute=rc)


@lru_cache(maxsize=1 << 12)
def head_s(shape: ModelShape, layout: Layout, dev: Device, value_bytes: int = 2) -> float:
    """Output projection (forward, dgrad, wgrad; BF16 under FP8 recipes) and the cross-entropy over
    the rank's vocab shard of logits (its s/cp tokens), for one micro-batch."""
    g = head_gemm(replace(shape, seq_len=shape.seq_len // layout.cp), layout)
    t = 3 * dev.gemm_s(g, "bf16" if value_bytes == 2 else "fp32", value_bytes)
    if dev.kernels.memory:
        logits = layout.micro_batch * shape.seq_len // layout.cp * g.n
        t += dev.mem_s(6 * logits, "softmax" if dev.fused_loss else "cross_entropy")
    return t


def fp8_shard_cast_s(shape: ModelShape, layout: Layout, dev: Device, gathers: int) -> float:
    """FSDP's FP8 all-gather casts the rank's shard of its stage's block weights before each of
    the step's ``gathers`` (``comm_time.weight_gathers_per_step``): FP8_SHARD_CAST_BYTES each."""
    layers = stage_layers(shape, layout.pp, layout.pp_split)
    shard = layers * shape.params_per_layer_on_rank(layout.tp) / layout.shard_group
    return gathers * dev.mem_s(FP8_SHARD_CAST_BYTES * shard, "add")


def optimizer_s(params_with_states: float, params_local: float, dev: Device) -> float:
    """AdamW over the rank's optimizer shard plus clipping over its gradients (memory-bound)."""
    if not dev.kernels.memory:
        return 0.0
    if dev.optimizer is not None:
        # a named AdamW (the eager FSDP stack): its own measured rate; clipping's two foreach
        # passes (the norms read 4 B, the scaling reads and writes 8) stream as an add does
        kind = "optimizer" if dev.optimizer == "fused" else "optimizer_foreach"
        return dev.mem_s(OPTIMIZER_BYTES * params_with_states, kind) + dev.mem_s(
            CLIP_BYTES * params_local, "add"
        )
    kind = (
        "optimizer"
        if dev.fused or "optimizer_foreach" not in dev.kernels.memory
        else "optimizer_foreach"
    )
    return dev.mem_s(OPTIMIZER_BYTES * params_with_states + CLIP_BYTES * params_local, kind)


@lru_cache(maxsize=1 << 14)
def _micro_terms(
    shape: ModelShape, layout: Layout, dev: Device, precision: str, value_bytes: int
) -> ComputeTerms:
    """One micro-batch on the busiest pipeline stage (no optimizer; ``StepModel.compute`` adds it).

    Stages take ceil(L/pp) layers each and the last the remainder, L − (pp−1)·ceil(L/pp), plus
    the output projection (Megatron's and DeepSpeed's default split); the "balanced" split
    (``shapes.PP_SPLITS``) gives the end stages one layer fewer: a micro-batch costs
    max(busiest·t_layer, last·t_layer + t_head) on the busiest stage."""
    lt = layer_terms(shape, layout, dev, precision, value_bytes)
    head = head_s(
        shape, Layout(cp=layout.cp, tp=layout.tp, micro_batch=layout.micro_batch), dev, value_bytes
    )
    layers = stage_layers(shape, layout.pp, layout.pp_split)
    last = last_stage_layers(shape, layout)
    first_busiest = layout.pp > 1 and layers * lt.total >= last * lt.total + head
    n = layers if first_busiest else last  # the busiest stage's layers
    return ComputeTerms(
        gemm=lt.gemm * n,
        attention=lt.attention * n,
        memory=lt.memory * n,
        head=0.0 if first_busiest else head,
        recompute=lt.recompute * n,
    )
