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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources

import yaml

from .efficiency import Gemm, GemmCurve, gemm_time, head_gemm, layer_gemms, op_recompute_gemms
from .shapes import Layout, ModelShape, last_stage_layers, stage_layers
from .hashing import cached_hash

# Unfused PyTorch moves this many times the bytes of the fused count for the same memory-bound work
# (measured: dtrain's eager GPT, d_model 2048, spent 237 ps per token and layer in elementwise
# kernels on the H100 against 95 ps for the count below;
# measured/h100-sxm/gpu-check-20261125-105450, step_profile).
EAGER_BYTES = 2.5
# FP8 casts per element of a linear layer's input and output gradient, in HBM bytes at the add
# kernel's rate, by how the run scales them (``Stack.fp8_scaling``):
#   dynamic  torchao's tensorwise float8 (torchtitan, dtrain), compiled: what it adds to the
#            memory-bound kernels of a Llama block (the global amax each scale waits for, the cast,
#            the transposed copy the other GEMM needs, the fusions the casts break). Measured: the
#            FP8 block's elementwise GPU time minus the bf16 block's, less the weights' casts
#            (FP8_WEIGHT_CAST_BYTES), layer_probe on one H200, Llama 3.1 405B at TP8 and 8B at
#            micro-batches 1-3, full AC (measured/h200/probe-20261126-0510): 8.7-17.2 B per element,
#            11.5 the geometric mean. Eager casts were not measured: at least the compiled bytes.
#   delayed  TransformerEngine's recipe (Megatron): the scale from the amax history, the cast fused
#            into the norm or activation that produces the tensor and into its transposed copy
#            (cast_transpose):
#            about 3 B per element by the kernels' count (read 2, write 1 and 1 transposed, less the
#            bf16 write it replaces). Not measured here: TransformerEngine cannot be brought to the
#            GPU machine.
#   eager    the same recipe without compile (torchao's matmul_with_hp_or_float8_args run op by
#            op): each tensor is cast twice, once per GEMM that reads it (the input for the
#            output and again for the weight gradient, the output gradient for the input and
#            the weight gradients), each cast unfused: the amax (abs: read 2, write 2; max: read
#            2), the scale, then to fp32 (read 2, write 4), times the scale (read 4, write 4),
#            the saturating clamp (read 4, write 4) and the fp8 cast (read 4, write 1): 33 B;
#            and one transposed copy for the weight-gradient GEMM (_scaled_mm wants its second
#            operand column-major: read 1, write 1): 2 x 33 + 2 = 68 B. Counted, not measured.
FP8_CAST_BYTES = {"dynamic": 11.5, "delayed": 3.0, "eager": 68.0}
# Dynamic scaling casts the block linears' weights at each use, per parameter of the rank's shard
# and micro-batch:
# forward 5 (amax: read 2; cast: read 2, write 1), backward 3 (the transposed cast with the
# forward's scale), and a full recompute's forward 5 again (_FORWARD_SHARE). Not on the layer when
# FSDP gathers the weights in FP8 (torchao enable_fsdp_float8_all_gather: the cast runs on the shard
# before the gather), nor with delayed scaling (TransformerEngine casts a weight once per step, its
# first micro-batch, and keeps it).
FP8_WEIGHT_CAST_BYTES = 8.0
# Eager (no compile): the weight is cast at both its uses (forward, input gradient), 33 B each
# from fp32 (abs 8, max 4, scale 8, clamp 8, fp8 cast 5), and copied transposed once (2): 68 B
EAGER_FP8_WEIGHT_CAST_BYTES = 68.0
# AdamW per parameter: reads param, grad, m, v and writes param, m, v (fp32): 28 B; clipping reads
# the gradients and scales them: 12 B.
OPTIMIZER_BYTES, CLIP_BYTES = 28.0, 12.0


@dataclass(frozen=True)
class AttentionCurve:
    """Fused attention forward+backward share of the bf16 peak: e(s) = e_max·s/(s + s_half)."""

    __hash__ = cached_hash

    e_max: float
    s_half: float
    hd64: float = 0.8
    # time multiplier of dropout on the probabilities inside the kernel (kernels.yaml, measured)
    dropout: float = 1.0

    def share(self, seq: int, head_dim: int) -> float:
        e = self.e_max * seq / (seq + self.s_half)
        return e * (self.hd64 if head_dim <= 64 else 1.0)


class FrozenMap(tuple):
    """A hashable read-only mapping (sorted (key, value) pairs), so a KernelModel can key a
    cache."""

    def __new__(cls, d: dict | None = None):
        obj = super().__new__(cls, sorted((d or {}).items()))
        obj._d = dict(obj)
        return obj

    def get(self, key, default=None):
        return self._d.get(key, default)

    def __getitem__(self, key):
        return tuple.__getitem__(self, key) if isinstance(key, int) else self._d[key]

    def __contains__(self, key) -> bool:
        return key in self._d

    def as_dict(self) -> dict:
        return dict(self._d)


@dataclass(frozen=True)
class KernelModel:
    """How fast one device runs each kind of kernel (``kernels.yaml``); ``memory`` None:
    memory-bound work is not modelled (a measured fixed overhead covers it), ``attention`` None:
    batched GEMMs."""

    __hash__ = cached_hash

    name: str
    gemm: FrozenMap  # dtype -> GemmCurve
    attention: AttentionCurve | None = None
    memory: FrozenMap | None = None  # kernel kind -> share of HBM bandwidth
    power_w: float | None = None
    sustained: float = (
        1.0  # share of the benchmark rate kept under continuous load (GEMM, attention)
    )
    sources: FrozenMap = field(default_factory=FrozenMap)
    gemm_measured: bool = (
        False  # the GEMM curve was measured on this GPU (gemm-probe): its clocks are in it
    )
    idle_w: float = 0.0  # board draw at idle, which a lower power cap cannot take from (W)

    def __post_init__(self) -> None:
        for name in ("gemm", "memory", "sources"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, FrozenMap(value))

    def with_gemm(self, dtype: str, curve: GemmCurve, source: str) -> KernelModel:
        return replace(
            self,
            gemm={**self.gemm.as_dict(), dtype: curve},
            sources={**self.sources.as_dict(), f"gemm_{dtype}": source},
            gemm_measured=True,
        )

    def power_scale(self, cap_w: float | None) -> float:
        """Time multiplier of compute-bound kernels under a board power cap below the table's:
        dynamic power ~ f·V² with V ~ f, so the clock falls as the cube root of the power above
        the idle draw."""
        if not (self.power_w and cap_w and cap_w < self.power_w):
            return 1.0
        return ((self.power_w - self.idle_w) / (cap_w - self.idle_w)) ** (1 / 3)


@lru_cache(maxsize=1)
def _table() -> dict:
    return yaml.safe_load(
        resources.files(__package__).joinpath("kernels.yaml").read_text(encoding="utf-8")
    )


@lru_cache(maxsize=64)
def published(gpu: str, attention: str = "flash") -> KernelModel | None:
    """The kernel table of a ``hardware.yaml`` profile (its ``attention`` kernel: flash | flash2
    | eager), None for a device without one."""
    e = _table().get(gpu)
    if e is None:
        return None
    gemm = {
        d: GemmCurve(c["e_max"], c["w_half_gflop"] * 1e9)
        for d in ("bf16", "fp8")
        if (c := e.get(f"gemm_{d}"))
    }
    a = e["attention"]["flash2" if attention == "flash2" else "flash"]
    curve = (
        None
        if attention == "eager"
        else AttentionCurve(a["e_max"], a["s_half"], a.get("hd64", 0.8), a.get("dropout", 1.0))
    )
    mem = {k: v for k, v in e["memory"].items() if k != "source"}
    return KernelModel(
        gpu,
        gemm,
        curve,
        mem,
        e.get("power_w"),
        e.get("sustained", 1.0),
        {
            "gemm": e["gemm_source"],
            "attention": a["source"],
            "memory": e["memory"]["source"],
            "sustained": e.get("sustained_source", ""),
            "idle": e.get("idle_source", ""),
        },
        idle_w=e.get("idle_w", 0.0),
    )


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


@dataclass(frozen=True)
class Device:
    """The rates one step runs at: peaks, the kernel model, HBM bandwidth, the power scale."""

    __hash__ = cached_hash

    peak_bf16: float
    peak_fp8: float | None
    hbm_Bps: float
    kernels: KernelModel
    power_scale: float = (
        1.0  # time multiplier of compute-bound kernels: sustained clocks, a lower power cap
    )
    fused: bool = True
    fused_loss: bool = True
    fp8_scaling: str = "delayed"  # Stack.fp8_casts: the FP8 casts' cost (FP8_CAST_BYTES)
    fp8_weight_gather: bool = (
        False  # FSDP gathers the block linears' weights in FP8 (Stack.fp8_all_gather tp+fsdp)
    )
    optimizer: str | None = None  # Stack.optimizer: the AdamW the stack names (None: as kernels)

    def gemm_s(self, g: Gemm, dtype: str = "bf16", value_bytes: int = 2) -> float:
        curve = self.kernels.gemm.get(dtype) or self.kernels.gemm["bf16"]
        peak = self.peak_fp8 if dtype == "fp8" and self.peak_fp8 else self.peak_bf16
        scale = self.power_scale * (
            self.kernels.sustained if self.kernels.gemm_measured and dtype != "fp8" else 1.0
        )
        return gemm_time(g, peak, self.hbm_Bps, curve, value_bytes) * scale

    def mem_s(self, nbytes: float, kind: str) -> float:
        mem = self.kernels.memory
        return 0.0 if mem is None else nbytes / (self.hbm_Bps * mem[kind])


def _local_heads(shape: ModelShape, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one TP rank; KV heads are replicated when tp > n_kv_head."""
    return max(1, shape.n_head // tp), max(1, shape.n_kv_head // tp)


def attention_s(
    shape: ModelShape, layout: Layout, dev: Device, forward_only: bool = False
) -> float:
    """The attention core of one layer and micro-batch on one rank (forward+backward, or its forward
    alone).

    With context parallelism each rank does 1/cp of the causal work: the ring's (and PyTorch's)
    load-balanced chunks in kernel calls over s/cp queries and keys (the benchmark's rate at
    s/cp), the all-to-all's full sequence for heads/cp of the heads (the rate at s)."""
    s, b, cp = shape.seq_len, layout.micro_batch, layout.cp
    hd = shape.d_model // shape.n_head
    heads, _ = _local_heads(shape, layout.tp)
    if dev.kernels.attention is not None:  # fused kernel: FLOPs executed over the benchmark's rate
        fwd = (
            2 * 2 * b * heads * s * s * hd / 2 / cp
        )  # causal: half of the s x s products; 1/cp per rank
        work = fwd if forward_only else 3.5 * fwd
        call = s if layout.cp_impl == "ulysses" else s // cp
        curve = dev.kernels.attention
        return (
            work
            / (dev.peak_bf16 * curve.share(call, hd))
            * dev.power_scale
            * (curve.dropout if shape.dropout else 1.0)
        )
    sq = s // cp  # eager: the rank's queries against every key, scores stored
    qk, av = Gemm(sq, s, hd, b * heads, "scores"), Gemm(sq, hd, s, b * heads, "av")
    t = (dev.gemm_s(qk) + dev.gemm_s(av)) * (1 if forward_only else 3)
    elems = (
        b * heads * sq * s
    )  # the stored scores: QKᵀ written, softmax forward (r+w) and backward (r, r, w)
    t += dev.mem_s(elems * (6 if forward_only else 12), "softmax") if dev.kernels.memory else 0.0
    if (
        shape.dropout and dev.kernels.memory
    ):  # dropout on the probabilities: r+w+mask forward, again backward
        t += dev.mem_s(elems * (5 if forward_only else 10), "dropout")
    return t


def memory_bytes(
    shape: ModelShape, layout: Layout, precision: str, fused: bool, fp8_scaling: str = "delayed"
) -> dict:
    """Bytes the memory-bound kernels of one layer move per micro-batch, forward+backward, by kind.

    Per token, 16-bit values, h_r the width of the replicated ops (h, or h/t with SP), on one TP
    rank:
      norm (2 per layer)      forward read+write, backward read x and dy, write dx: 2·10·h_r
      add (2 residuals)       forward 3 passes, backward the gradient sum 3: 2·12·h_r
      RoPE on q and k         4 bytes per element forward, 4 backward
      MLP activation          GELU 10·F/t (forward 2 passes, backward 3), SwiGLU 16·F/t (3 + 5)
      dropout (if any)        2 layers x (forward r+w+mask, backward r+mask+w): 2·10·h_r
      FP8 casts               each block linear's input and output gradient, FP8_CAST_BYTES per
                              element by scaling
      torch CP merges         ``cp_merge_bytes`` (PyTorch's context_parallel, cp > 1)
    """
    t, h = layout.tp, shape.d_model
    h_r = h / t if layout.sequence_parallel else h
    heads, kv_heads = _local_heads(shape, t)
    hd = h // shape.n_head
    f = shape.ffn_hidden / t
    out = {
        "norm": 20 * h_r,
        "add": 24 * h_r,
        "act_swiglu" if shape.gated_mlp else "act_gelu": (16 if shape.gated_mlp else 10) * f,
    }
    if shape.rotary:
        out["rope"] = 8 * (heads + kv_heads) * hd
    if shape.dropout:
        out["dropout"] = 20 * h_r
    if precision == "fp8":
        q, kv = heads * hd, kv_heads * hd
        elems = (h + (q + 2 * kv)) + (q + h) + (h + (2 if shape.gated_mlp else 1) * f) + (f + h)
        if fp8_scaling == "eager":  # eager models run q, k, v as three linears: three inputs
            elems += 2 * h
        out["fp8_cast"] = FP8_CAST_BYTES[fp8_scaling] * elems
    if layout.cp > 1 and layout.cp_impl == "torch":
        out["cp_merge_fwd"], out["cp_merge_bwd"] = cp_merge_bytes(layout.cp, heads * hd)
    tokens = layout.micro_batch * shape.seq_len
    scale = 1.0 if fused else EAGER_BYTES
    return {k: v * tokens * (1.0 if k in _COUNTED_AS_RUN else scale) for k, v in out.items()}


def cp_merge_bytes(cp: int, width: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per local token of one layer that PyTorch's ring attention
    moves outside its kernels (torch/distributed/tensor/experimental/_attention.py:
    ``_templated_ring_attention``, ``_SDPAMerger``, ``_partial_update``,
    ``_templated_ring_attention_backward``), eager PyTorch ops on tensors of ``width`` = query heads
    x head dim per token (K and V as SDPA gets them, repeated to the query heads), 16-bit inputs,
    fp32 accumulators (``convert_to_f32``). Per ring step after the first, the two load-balanced
    cases (whole chunk; half the queries, written back with a concatenation) averaged:
      forward   K, V concatenated for the rotation 8; the block output upcast 4.5; the merge
                out - sigmoid(lse_b - lse) * (out - out_b), 8 fp32 passes, or 4 + the concatenation
                8: 28 -> 40.5; once: the first output upcast and the result cast back, 12
      backward  K, V concatenated 8; dK, dV added into fp32 (r 6, w 4 each) or half-added +
                concatenated: 23; dK, dV concatenated for the ring 16; dQ added (10) or
                half-added + concatenated (13): 11.5 -> 58.5; once: three fp32 zero buffers 12,
                the first step's adds and concatenation 46, the casts back 18: 76"""
    steps = cp - 1
    return (40.5 * steps + 12) * width, (58.5 * steps + 76) * width


# byte counts of the ops as they run, fused or not (FP8_CAST_BYTES counts the casts as they run;
# PyTorch's ring attention merges in eager ops whatever compiles around it): --kernels eager does
# not scale them
_COUNTED_AS_RUN = frozenset({"fp8_cast", "cp_merge_fwd", "cp_merge_bwd"})
# which measured share each byte count streams at
_KIND = {
    "norm": "norm",
    "add": "add",
    "rope": "norm",
    "act_gelu": "act_gelu",
    "act_swiglu": "act_swiglu",
    "dropout": "dropout",
    "fp8_cast": "add",
    "cp_merge_fwd": "add",
    "cp_merge_bwd": "add",
}
# share of each kind's bytes that the forward moves (what full recompute runs again)
_FORWARD_SHARE = {
    "norm": 0.4,
    "add": 0.5,
    "rope": 0.5,
    "act_gelu": 0.4,
    "act_swiglu": 0.375,
    "dropout": 0.5,
    "fp8_cast": 0.5,
    "fp8_weight_cast": 5 / 8,
    "cp_merge_fwd": 1.0,
    "cp_merge_bwd": 0.0,
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
    # FSDP (ZeRO 2/3) gathering the weights in FP8 casts them on the shard, off the layer
    weight_casts = (
        precision == "fp8"
        and dev.fp8_scaling in ("dynamic", "eager")
        and not (dev.fp8_weight_gather and layout.zero_stage >= 2)
    )
    return _layer_terms(shape, key, dev, precision, value_bytes, weight_casts)


@lru_cache(maxsize=1 << 14)
def _layer_terms(
    shape: ModelShape,
    layout: Layout,
    dev: Device,
    precision: str,
    value_bytes: int,
    weight_casts: bool = False,
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
    mem = (
        {
            k: dev.mem_s(v, _KIND[k])
            for k, v in memory_bytes(shape, layout, precision, dev.fused, dev.fp8_scaling).items()
        }
        if dev.kernels.memory
        else {}
    )
    if weight_casts and mem:
        per_param = (
            EAGER_FP8_WEIGHT_CAST_BYTES if dev.fp8_scaling == "eager" else FP8_WEIGHT_CAST_BYTES
        )
        mem["fp8_weight_cast"] = dev.mem_s(
            per_param * shape.params_per_layer_on_rank(layout.tp), "add"
        )
    rc = 0.0
    if layout.recompute == "full":
        rc = (
            fwd_gemm
            + attention_s(attention, layout, dev, forward_only=True)
            + sum(t * _FORWARD_SHARE[k] for k, t in mem.items())
        )
    elif layout.recompute == "selective":  # the attention core again, with its ring's merges
        rc = attention_s(attention, layout, dev, forward_only=True) + mem.get("cp_merge_fwd", 0.0)
    elif layout.recompute == "op":  # SDPA's output is saved: no attention (nor its merges) re-run
        rc = sum(
            dev.gemm_s(g, dtype, value_bytes) for g in op_recompute_gemms(shape, layout)
        ) + sum(t * _FORWARD_SHARE[k] for k, t in mem.items() if k not in ("add", "cp_merge_fwd"))
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
