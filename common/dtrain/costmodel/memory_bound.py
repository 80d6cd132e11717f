"""Bytes the memory-bound kernels of one layer move per micro-batch (``memory_bytes``: norms,
residual adds, RoPE, the MLP activation, dropout, FP8 casts, PyTorch's ring-attention merges), the
byte counts they are built from (eager PyTorch's factor, the FP8 casts per element and per weight)
and, per kind, the measured HBM share it streams at and the forward's share (what full recompute
runs again); ``compute.layer_terms`` turns them into seconds."""

from __future__ import annotations

from .attention_time import local_heads
from .shapes import Layout, ModelShape


# Unfused PyTorch moves this many times the bytes of the fused count for the same memory-bound work
# (measured: dtrain's eager GPT, d_model 2048, spent 237 ps per token and layer in elementwise
# kernels on the H100 against 95 ps for the count below;
# measured/h100-sxm/gpu-check-20261125-105450, step_profile).
EAGER_BYTES = 2.5
# The same eager step in bf16 parameters without autocast (FSDP2's MixedPrecisionPolicy: dtrain's
# trainer and the eager stack under ZeRO-2/3) moves this share of autocast's bytes: no casts of the
# linears' inputs and of their gradients, a bf16 residual stream, bf16 norms. Counted from the ops
# PyTorch dispatches (python -m dtrain.gpucheck.eager_bytes, per token and layer: 125m and 350m
# 114 of 226 x d_model B, 0.504; 1b and 7b 96 of 208, 0.462), the geometric mean. The autocast
# count itself is 2.48-2.69x the fused one, the GPU's EAGER_BYTES 2.5 (tests/test_eager_bytes.py).
# A stack that keeps autocast on over FSDP's bf16 parameters (Accelerate's FSDP with
# mixed_precision="bf16") moves more: CUDA autocast runs LayerNorm in fp32 (casts in and out), which
# the CPU's autocast, where this is counted, does not.
BF16_PARAMS_BYTES = 0.48
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
#            operand column-major: read 1, write 1): 2 x 33 + 2 = 68 B. The bytes are counted;
#            their rate is measured: gpu-check's membound times torchao's own cast
#            (fp8_cast_eager_bf16, 33 B per element by the ops it dispatches,
#            tests/test_eager_fp8_cast.py), kernels.yaml ``fp8_cast_eager`` (memory_kind), 0.75
#            of the H100's HBM bandwidth at d_model 4096 where a residual add reaches 0.89.
FP8_CAST_BYTES = {"dynamic": 11.5, "delayed": 3.0, "eager": 68.0}
# Dynamic scaling casts the block linears' weights at each use, per parameter of the rank's shard
# and micro-batch:
# forward 5 (amax: read 2; cast: read 2, write 1), backward 3 (the transposed cast with the
# forward's scale), and a full recompute's forward 5 again (FORWARD_SHARE). Not on the layer when
# FSDP gathers the weights in FP8 (torchao enable_fsdp_float8_all_gather: the cast runs on the shard
# before the gather), nor with delayed scaling (TransformerEngine casts a weight once per step, its
# first micro-batch, and keeps it).
FP8_WEIGHT_CAST_BYTES = 8.0
# FSDP gathering the weights in FP8 (torchao enable_fsdp_float8_all_gather): the shard is cast
# before the gather and the forward GEMM reads the gathered FP8 weight as it is; the input-gradient
# GEMM wants it column-major, a transposed copy per micro-batch (read 1, write 1; torchao
# float8_mm's ``b_data.t().contiguous().t()``), which a recompute does not repeat; and before each
# gather the shard's cast to FP8 (read 4, write 1 per element of the rank's shard; the scale's amax
# precomputed once a step), FP8_SHARD_CAST_BYTES per shard element and gather
# (compute.fp8_shard_cast_s)
FP8_GATHERED_WEIGHT_BYTES = 2.0
FP8_SHARD_CAST_BYTES = 5.0
# Eager (no compile): the weight is cast at both its uses (forward, input gradient), 33 B each
# from fp32 (abs 8, max 4, scale 8, clamp 8, fp8 cast 5), and copied transposed once (2): 68 B
EAGER_FP8_WEIGHT_CAST_BYTES = 68.0


def memory_bytes(
    shape: ModelShape,
    layout: Layout,
    precision: str,
    fused: bool,
    fp8_scaling: str = "delayed",
    bf16_params: bool = False,
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
    heads, kv_heads = local_heads(shape, t)
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
    # eager: EAGER_BYTES x the count, under autocast, or BF16_PARAMS_BYTES of it in bf16 parameters
    scale = 1.0 if fused else EAGER_BYTES * (BF16_PARAMS_BYTES if bf16_params else 1.0)
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
MEMORY_KIND = {
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


def memory_kind(key: str, fp8_scaling: str) -> str:
    """The measured share a ``memory_bytes`` entry streams at: ``MEMORY_KIND``, but FP8 casts run
    op by op (eager scaling) at the rate gpu-check's membound measured for torchao's unfused cast
    (kernels.yaml ``fp8_cast_eager``), not a residual add's."""
    if key == "fp8_cast" and fp8_scaling == "eager":
        return "fp8_cast_eager"
    return MEMORY_KIND[key]


def memory_widths(shape: ModelShape, layout: Layout, fp8_scaling: str = "") -> dict[str, float]:
    """The row width each by-width kind of ``memory_bytes`` walks on one TP rank (the key of
    kernels.yaml's ``by_width`` shares): the norms, residual adds and dropout the model width
    (h/t with sequence parallelism), the MLP activation its hidden width over TP, eager FP8 casts
    the model width. The other kinds (RoPE, fused FP8 casts, ring-attention merges) take their
    kind's median share."""
    t, h = layout.tp, shape.d_model
    h_r = h / t if layout.sequence_parallel else h
    act = "act_swiglu" if shape.gated_mlp else "act_gelu"
    out = {"norm": h_r, "add": h_r, "dropout": h_r, act: shape.ffn_hidden / t}
    if fp8_scaling == "eager":
        out["fp8_cast"] = h_r
    return out


# share of each kind's bytes that the forward moves (what full recompute runs again)
FORWARD_SHARE = {
    "norm": 0.4,
    "add": 0.5,
    "rope": 0.5,
    "act_gelu": 0.4,
    "act_swiglu": 0.375,
    "dropout": 0.5,
    "fp8_cast": 0.5,
    "fp8_weight_cast": 5 / 8,
    "fp8_weight_copy": 0.0,
    "cp_merge_fwd": 1.0,
    "cp_merge_bwd": 0.0,
}
