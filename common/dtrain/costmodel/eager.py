"""The eager FSDP stack (``--software fsdp-eager``): a step's cost when PyTorch runs it op by op.

Hugging Face Accelerate / Trainer with FSDP, Lightning, Composer and this project's own trainer
without ``torch.compile`` run the model eagerly: every norm, activation, cast and the loss is its
own kernel (``Stack.kernels`` "eager", ``loss`` "eager"), attention is FlashAttention-2 (SDPA's
flash backend or flash-attn 2), AdamW is PyTorch's foreach implementation (``Stack.optimizer``
"foreach"; "fused" where the run asks for it) and data parallelism is FSDP (ZeRO-3, or ZeRO-2 with
``reshard_after_forward=False``). On top of the GPU work priced term by term in ``compute``, it
adds:

  kernel launches  ``kernel_counts``: per step, by the step profile's categories, counted from the
                   model's structure (below) and, for the optimizer, from how PyTorch's
                   ``multi_tensor_apply`` splits a foreach op into launches
                   (``foreach_launches``); checked against the measured counts in
                   measured/h200/probe-20261126-0510/step_profile.json (tests/test_eager.py)
  dispatch floor   ``dispatch_floor_s``: the host issues kernels one after another, so a step
                   takes at least launches x the host's measured seconds per launch (eager.yaml:
                   a host's issue time of whole eager steps, cpu_dispatch_s, over these counts:
                   Python, autograd and autocast per op, not the bare launch), plus FSDP2's hooks
                   per wrapped unit (``host_launches``); when that floor exceeds the GPU's work
                   the step is launch-bound and takes the host's time: the measured steps end
                   0.5-2.3 ms after their host issue (125M at 1 x 2K and 8 x 1K tokens), the
                   optimizer's GPU work running while the host still issues it
  FSDP overlap     ``fsdp_hidden``: FSDP2 gathers one block's weights while the previous block
                   computes; at a small per-rank batch a block's compute is shorter than its
                   gather and the difference is exposed, block by block, with the first gather
                   and the last reduce-scatter behind nothing

Launch counts per transformer block and micro-batch (dtrain's GPT under bf16 autocast, which is
the eager stack's model: pre-norm blocks, q/k/v/o and the MLP as separate linears):
  gemm        3 per linear (forward, input gradient, weight gradient): 6 linears, 7 gated
  attention   4: the flash forward; backward its preprocess (dO·O), the main kernel, the dQ
              conversion
  elementwise 40 (+16 with biases), memcpy / memset included: forward the two norms, the
              autocast casts of the linears' inputs and weights, the attention output's copy to
              contiguous, the activation, the two residual adds (16); backward the casts of the
              branch gradients and of the weight gradients back to fp32, the norms' and the
              activation's backward, the sums of the q/k/v input gradients and of the residual
              stream (24). With biases each linear adds its bias cast and its gradient's sum and
              cast, and LayerNorm its bias' gradient: 16, the measured difference of the 125M
              (biased) and the 1B/7B (unbiased) profiles per block
  FP8         torchao's tensorwise casts without compile: 80 elementwise launches per linear
              (``FP8_LAUNCHES_PER_LINEAR``, the measured FP8 and bf16 profiles' difference)
per micro-batch, outside the blocks: the output projection's 3 GEMMs, the loss's 4 kernels
(log-softmax and NLL, forward and backward);
per step: ``STEP_ELEMENTWISE`` (embeddings and their backward, the final norm, the logits' fp32
cast and its gradient, clipping's scalar math, the loss read back), the one number here taken from
the measured counts: the 1B/8-layer and 7B/4-layer profiles less 40 per block (157 and 154).

Under FSDP2 the trainer runs no autocast (bf16 parameters): ``dtrain.gpucheck.eager_bytes`` counts
22 (RMSNorm, no bias) to 34 (LayerNorm, biases) fewer elementwise ops per block than under autocast,
and its GPU time prices that (``memory_bound.BF16_PARAMS_BYTES``). The launch count keeps
autocast's: with it the trainer's launch-bound FSDP2 steps (125M at 8 x 2K and 2 x 8K tokens on the
H100) are predicted at -1% and -7%, without it at -18% and -23%, so FSDP2's hooks cost a
GPU's host more per unit than ``fsdp2_unit``'s CPU probe shows (it runs gloo, no CUDA streams or
events), by about those ops. The probe on an H100 host's CPU gives 132 launches per unit, against
which the same host's runs vary by a fifth (eager.yaml); ``host_launches`` takes a host's own probe
where one was run there (``unit_launches``: dtrain backtest --measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml

from .shapes import Layout, ModelShape, stage_layers

SOFTWARE = "fsdp-eager"
# what --software fsdp-eager runs unless told otherwise (``Stack`` fields)
STACK_DEFAULTS = {
    "attention": "flash2",
    "kernels": "eager",
    "loss": "eager",
    "optimizer": "foreach",
}
OPTIMIZERS = ("foreach", "fused")

# PyTorch's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh): a foreach op
# launches a kernel whenever it has filled MAX_BLOCKS chunks of CHUNK elements or its depth's
# tensor slots (ops with a list of scalars have fewer slots at depth 1)
CHUNK, MAX_BLOCKS = 65536, 320
MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
MAX_TENSORS_SCALAR_LIST = {1: 96, 2: 64, 3: 48, 4: 36, 5: 30}
# (op, depth = tensor lists it walks, takes a list of scalars): torch/optim/adam.py
# _multi_tensor_adam with decoupled weight decay (AdamW), capturable=False (the steps stay on the
# CPU), and torch.nn.utils.clip_grad_norm_ (the gradients' norms, then their scaling)
FOREACH_ADAMW = (
    ("mul_ (weight decay)", 1, False),
    ("lerp_ (first moment)", 2, False),
    ("mul_ (second moment)", 1, False),
    ("addcmul_ (second moment)", 3, False),
    ("sqrt", 2, False),
    ("div_ (bias correction)", 1, True),
    ("add_ (eps)", 1, False),
    ("addcdiv_ (update)", 3, True),
)
FUSED_ADAMW = (("_fused_adamw_", 4, False),)  # params, grads, exp_avg, exp_avg_sq in one kernel
CLIP = (("_foreach_norm", 1, False), ("mul_ (clip)", 1, False))
# one more optimizer-category kernel per step than the foreach ops launch, in each of the three
# measured profiles (71, 261, 521 against 70, 260, 520)
OPTIMIZER_EXTRA = 1
GEMMS_PER_LINEAR, ATTENTION_PER_LAYER, LOSS_KERNELS = 3, 4, 4
ELEMENTWISE_PER_LAYER, BIAS_ELEMENTWISE_PER_LAYER, STEP_ELEMENTWISE = 40, 16, 155
GATED_ELEMENTWISE = 5  # SwiGLU: w3's casts (2), SiLU and the product forward (2)... by op count
# what full activation checkpointing runs again per block: the forward's share of the counts above
# (one GEMM per linear, the flash forward, the forward's 16 elementwise kernels, +6 bias casts)
FORWARD_ELEMENTWISE, BIAS_FORWARD_ELEMENTWISE = 16, 6
# torchao's tensorwise FP8 without compile, per block linear and micro-batch: six casts (input,
# weight and output gradient, each twice), each its amax (abs, max), the scale's one-element ops and
# the scaled, clamped cast; the transposed copies and scale reciprocals _scaled_mm needs. Counted
# from the profile, not the ops: the 7B/4-layer step (24 linears) launches 2,849 kernels in FP8 and
# 929 in bf16 (measured/h100-sxm/gpu-check-20261127-164510: eager_sweep, step_profile): 80 each.
# The forward runs two of the six casts: a full recompute runs a third of them again.
FP8_LAUNCHES_PER_LINEAR = 80
# FSDP2 per unit (block or root) and micro-batch: an all-gather is the copy-in, the collective and
# the copy-out (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather,
# foreach_all_gather_copy_out), a reduce-scatter the chunk_cat copy-in, the collective and the
# divide; counted from those functions, not measured
FSDP_GATHER_KERNELS, FSDP_REDUCE_KERNELS = 3, 3


@dataclass(frozen=True)
class Structure:
    """What the launch count needs beyond ``ModelShape``: biases on the linears (and norms), and
    learned positions (one more embedding tensor)."""

    bias: bool = False
    learned_positions: bool = False


def foreach_launches(numels: list[int] | tuple[int, ...], depth: int, scalar_list: bool) -> int:
    """Kernel launches of one foreach op over tensors of these sizes (``multi_tensor_apply``)."""
    slots = (MAX_TENSORS_SCALAR_LIST if scalar_list else MAX_TENSORS)[depth]
    launches = blocks = tensors = 0
    for numel in numels:
        if numel == 0:
            continue
        tensors += 1
        chunks = -(-numel // CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (tensors == slots and last) or blocks == MAX_BLOCKS:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1  # a tensor cut mid-way starts the next launch
    return launches + (blocks > 0)


def param_numels(
    shape: ModelShape, structure: Structure = Structure(), shards: int = 1
) -> tuple[int, ...]:
    """The parameter tensors one rank's optimizer walks, in the model's order: FSDP2 shards every
    tensor over ``shards`` ranks (dim-0 chunks: ceil(numel / shards) each, the largest)."""
    d, hd = shape.d_model, shape.d_model // shape.n_head
    kv, f = shape.n_kv_head * hd, shape.ffn_hidden
    b = structure.bias
    norm = (d, d) if b else (d,)
    linears = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (f, d)]
    if shape.gated_mlp:
        linears.insert(5, (d, f))
    block = [*norm]
    for i, (n_in, n_out) in enumerate(linears):
        if i == 4:  # the MLP's norm before its first linear
            block += norm
        block += [n_in * n_out] + ([n_out] if b else [])
    out = [shape.vocab * d] + ([shape.seq_len * d] if structure.learned_positions else [])
    out += block * shape.n_layer + list(norm)
    if not shape.tied_embeddings:
        out.append(shape.vocab * d)
    return tuple(-(-n // shards) for n in out)


@lru_cache(maxsize=256)
def optimizer_launches(numels: tuple[int, ...], optimizer: str = "foreach") -> int:
    """Kernels one AdamW step and gradient clipping launch over these tensors."""
    ops = (FUSED_ADAMW if optimizer == "fused" else FOREACH_ADAMW) + CLIP
    return sum(foreach_launches(numels, depth, sl) for _, depth, sl in ops) + OPTIMIZER_EXTRA


def kernel_counts(
    shape: ModelShape,
    layout: Layout,
    structure: Structure = Structure(),
    optimizer: str = "foreach",
    fp8: bool = False,
) -> dict[str, int]:
    """Kernel launches of one step on the busiest rank by the step profile's categories (the
    module docstring's counts); FSDP2's collectives' kernels under "fsdp" (ZeRO-2/3 with more
    than one data shard); ``fp8``: torchao's eager casts (FP8_LAUNCHES_PER_LINEAR) under
    "elementwise"."""
    m = layout.grad_accum
    layers = stage_layers(shape, layout.pp, layout.pp_split)
    linears = 7 if shape.gated_mlp else 6
    per_layer = ELEMENTWISE_PER_LAYER + (BIAS_ELEMENTWISE_PER_LAYER if structure.bias else 0)
    per_layer += GATED_ELEMENTWISE if shape.gated_mlp else 0
    shards = layout.shard_group if layout.zero_stage >= 2 else 1  # FSDP shards both stages
    numels = param_numels(shape, structure, shards)
    out = {
        "gemm": m * (layers * linears * GEMMS_PER_LINEAR + GEMMS_PER_LINEAR),
        "attention": m * layers * ATTENTION_PER_LAYER,
        "loss": m * LOSS_KERNELS,
        # gradient accumulation: one add per parameter tensor for each micro-batch after the first
        "elementwise": m * layers * per_layer + STEP_ELEMENTWISE + (m - 1) * len(numels),
        "optimizer": optimizer_launches(numels, optimizer),
    }
    if fp8:
        out["elementwise"] += m * layers * linears * FP8_LAUNCHES_PER_LINEAR
    if layout.recompute == "full":
        fwd = FORWARD_ELEMENTWISE + (BIAS_FORWARD_ELEMENTWISE if structure.bias else 0)
        fwd += linears * FP8_LAUNCHES_PER_LINEAR // 3 if fp8 else 0
        out["gemm"] += m * layers * linears
        out["attention"] += m * layers
        out["elementwise"] += m * layers * fwd
    if layout.zero_stage >= 2 and layout.shard_group > 1:
        gathers = 2 if layout.zero_stage == 3 else 1  # ZeRO-2 (FSDP2): gathers once per micro
        out["fsdp"] = m * (layers + 1) * (gathers * FSDP_GATHER_KERNELS + FSDP_REDUCE_KERNELS)
    return out


def kernels_per_step(
    shape: ModelShape,
    layout: Layout,
    optimizer: str = "foreach",
    structure: Structure = Structure(),
) -> int:
    """Every kernel launch of one step (``kernel_counts`` summed)."""
    return sum(kernel_counts(shape, layout, structure, optimizer).values())


@lru_cache(maxsize=1)
def _hosts() -> dict:
    text = resources.files(__package__).joinpath("eager.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def host_op_s(gpu: str) -> tuple[float, str]:
    """(seconds the host takes to issue one op, its source) for a ``hardware.yaml`` GPU."""
    row = _hosts().get(gpu) or _hosts()["default"]
    return float(row["host_op_s"]), " ".join(row["source"].split())


def dispatch_floor_s(kernels: int, host_s: float) -> float:
    """The shortest step the host can issue ``kernels`` launches in, one ``host_s`` each."""
    return kernels * host_s


def fsdp_unit_launches() -> tuple[float, str]:
    """(FSDP2's host work per wrapped unit and micro-batch in launch equivalents, its source)."""
    row = _hosts()["fsdp2_unit"]
    return float(row["launches"]), " ".join(row["source"].split())


def host_launches(
    shape: ModelShape,
    layout: Layout,
    counts: dict[str, int],
    unit_launches: float | None = None,
) -> float:
    """What the host issues in one step, in launches: the kernels (``kernel_counts``) and, where
    FSDP2 wraps the model (ZeRO-2/3, on one rank too), its hooks' work per unit (each block and
    the root) and micro-batch: ``unit_launches`` (a host's own probe), else
    ``fsdp_unit_launches``."""
    n = float(sum(counts.values()))
    if layout.zero_stage >= 2:
        units = stage_layers(shape, layout.pp, layout.pp_split) + 1
        per_unit = fsdp_unit_launches()[0] if unit_launches is None else unit_launches
        n += units * layout.grad_accum * per_unit
    return n


def fsdp_hidden(gather: float, reduce: float, work: float, units: int, micro_batches: int) -> float:
    """How much of a ZeRO-3 step's FSDP traffic runs behind ``work`` (the step's compute less the
    optimizer), unit by unit: ``gather`` the step's all-gathers (per unit and micro-batch one in
    forward, one in backward), ``reduce`` its reduce-scatters (one per unit and micro-batch). In
    forward a unit's gather runs behind the previous unit's forward (a third of its work), in
    backward the next gather and the reduce-scatter behind its backward (two thirds); the first
    gather of each micro-batch and the step's last reduce-scatter wait for nothing."""
    n = units * micro_batches
    if n <= 0 or gather + reduce <= 0:
        return 0.0
    g, r, w = gather / (2 * n), reduce / n, work / n
    fwd = (n - micro_batches) * min(g, w / 3)
    bwd = (n - 1) * min(g + r, 2 * w / 3) + min(g, 2 * w / 3)
    return min(gather + reduce, fwd + bwd)


# Bytes per linear-layer parameter and micro-batch that eager mixed precision moves outside the
# kernels the compute terms count: the weight cast to bf16 for the forward (read 4, write 2; torch
# autocast's cast, or FSDP's MixedPrecisionPolicy cast before its gather) and the bf16 weight
# gradient's cast back to fp32 (read 2, write 4), each an elementwise pass at the add kernel's rate
WEIGHT_CAST_BYTES = 12.0


def linear_params(shape: ModelShape, layout: Layout) -> float:
    """The linear layers' weights one micro-batch runs on the busiest rank: its stage's blocks
    and the output projection (the token embedding runs in fp32: not cast)."""
    layers = stage_layers(shape, layout.pp, layout.pp_split)
    n = shape.param_count
    return (layers * n.matmul_per_layer + n.lm_head) / layout.tp


def weight_cast_s(shape: ModelShape, layout: Layout, dev) -> float:
    """``WEIGHT_CAST_BYTES`` over the step's micro-batches, at the add kernel's rate."""
    return layout.grad_accum * dev.mem_s(WEIGHT_CAST_BYTES * linear_params(shape, layout), "add")


# Gradient accumulation through PyTorch's AccumulateGrad: each micro-batch after the first adds
# its weight gradients into the .grad (FSDP2: into the reduced shard), read 2 and write 1 values
# of the .grad's dtype (fp32 weights 12 bytes, 16-bit weights 6), at the add kernel's
# rate. Priced on the PyTorch stacks (the eager stack, dtrain's trainer, torchtitan: FSDP2 or
# DDP over fp32 weights) and under DeepSpeed's ZeRO-1 with 16-bit gradients (timemodel
# ``grad_accum_s``); Megatron fuses the accumulation into the weight-gradient GEMM
# (gradient_accumulation_fusion: no pass of its own)
GRAD_ACCUM_VALUES = 3
ACCUMULATING_SOFTWARE = (SOFTWARE, "dtrain", "torchtitan")
# Under PP, torch.distributed.pipelining syncs FSDP2's gradients on the last micro-batch only
# (PipelineStage.backward_maybe_with_nosync): the stage's unsharded gradients accumulate between
# syncs in the reduce dtype, as memory.memory_per_gpu holds them. FSDPParam's
# to_accumulated_grad_if_needed upcasts the first micro-batch's bf16 gradient (read 2, write 4
# bytes), accumulate_unsharded_grad_if_needed adds each later one (read 4 + 2, write 4). A bf16
# reduce dtype is the parameters' own: AccumulateGrad adds in bf16 (GRAD_ACCUM_VALUES x 2 B).
UNSHARDED_UPCAST_BYTES = 6
UNSHARDED_ADD_BYTES = 10


def grad_accum_s(local_params: float, micro_batches: int, dev, grad_bytes: int = 4) -> float:
    """The step's gradient-accumulation adds over ``local_params`` (the rank's gradient) of
    ``grad_bytes`` per value."""
    nbytes = GRAD_ACCUM_VALUES * grad_bytes * local_params
    return max(0, micro_batches - 1) * dev.mem_s(nbytes, "add")


def unsharded_grad_accum_s(
    stage_params: float, micro_batches: int, dev, grad_bytes: int = 4
) -> float:
    """FSDP2's accumulation of a pipeline stage's unsharded gradients over ``micro_batches``
    (``UNSHARDED_ADD_BYTES``): nothing for one micro-batch, whose gradients are reduced as they
    come."""
    if micro_batches <= 1:
        return 0.0
    if grad_bytes == 2:
        return grad_accum_s(stage_params, micro_batches, dev, grad_bytes)
    first = dev.mem_s(UNSHARDED_UPCAST_BYTES * stage_params, "add")
    return first + (micro_batches - 1) * dev.mem_s(UNSHARDED_ADD_BYTES * stage_params, "add")


# FSDP2 (fully_shard) copies every all-gather out of its flat output into the parameters'
# unsharded tensors on the compute stream, after waiting for the gather
# (_fsdp_collectives.py foreach_all_gather_copy_out: split_with_sizes_copy), reading and writing
# each gathered value: 2 passes over the gathered bytes (counted on this CPU: 2 B written per bf16
# parameter and gather over 2 gloo ranks). A one-rank FSDP2 gathers nothing (not priced).
FSDP2_COPY_OUT_PASSES = 2


def fsdp2_copy_out_s(gathered_bytes: float, gathers: int, dev) -> float:
    """The copy-outs of ``gathers`` all-gathers of ``gathered_bytes`` each, at the add kernel's
    rate."""
    return gathers * dev.mem_s(FSDP2_COPY_OUT_PASSES * gathered_bytes, "add")
