"""The memory-bound work of dtrain's GPT blocks run eagerly, counted from the ops PyTorch
dispatches: bytes and kernels per token and layer, for the cost model's eager terms
(``costmodel.memory_bound.EAGER_BYTES`` checked, ``BF16_PARAMS_BYTES`` counted, and the launch
note in ``costmodel.eager``); and torchao's eager FP8 cast of one tensor (``eager_fp8_cast``),
which gpu-check's ``membound`` times.

    python -m dtrain.gpucheck.eager_bytes [--preset 125m] [--width 256] [--json]

Two ways the trainer runs a bf16 step (``dtrain.train.trainer._default_autocast``):
  autocast   without FSDP: fp32 parameters under bf16 autocast; the embedding's output and every
             residual add are fp32, each linear's input is cast to bf16 and its weight gradient
             back to fp32, the norms run in fp32
  bf16       FSDP2 (zero2, zero3): ``MixedPrecisionPolicy(param_dtype=bf16)`` hands the blocks
             bf16 parameters and the trainer runs no autocast, so the whole block computes in bf16
             (the parameters' casts are FSDP's copy-in and copy-out, priced apart)

A forward and backward of the whole model (its loss included) under a ``TorchDispatchMode`` that
adds up, for every op but the GEMMs, attention, views and collectives, the bytes of its tensor
inputs and outputs (what a CUDA kernel of the op reads and writes) and one kernel. Run at two depths
and two sequence lengths, the double difference is the blocks' work per token and layer alone (the
embedding, loss and the weights' casts drop out: they do not grow with both). On the CPU: its
autocast casts what CUDA's does for this model (the linears' inputs to bf16, fp32 norms on the fp32
residual stream), and each op here is one kernel there but LayerNorm's backward (one op here, two
kernels on CUDA: the input gradient, then the weight and bias gradients). RMSNorm presets are
counted with LayerNorm: CPU's ``rms_norm`` is composite, CUDA's one fused kernel of LayerNorm's
bytes.
"""

from __future__ import annotations

import json
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BATCH, VOCAB = 2, 512
DEPTHS, SEQS = (1, 3), (128, 256)
MODES = ("autocast", "bf16")
# ops that are not memory-bound kernels of their own: the GEMMs, allocation, and _unsafe_view (a
# view its schema does not mark as one); attention and the views proper are found by name and schema
SKIPPED = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "empty",
    "empty_like",
    "empty_strided",
    "_unsafe_view",
)


# torchao's dynamic tensorwise cast of one tensor run op by op (no compile), per element of a 16-
# or 32-bit input: the amax (abs: read, write; max: read), a bf16 input's upcast to fp32 (read 2,
# write 4), times the scale (read 4, write 4), the saturating clamp (read 4, write 4), the fp8 cast
# (read 4, write 1): 33 bytes either way; its scale's scalar ops (5 one-element kernels) on top.
# costmodel/memory_bound.py FP8_CAST_BYTES["eager"] counts two of these per tensor; gpu-check's
# membound times it (gpucheck.membound)
EAGER_FP8_CAST_BYTES = 33


def eager_fp8_cast(t: torch.Tensor):
    """A call that casts ``t`` to float8 e4m3 as torchao's float8 training does it for a linear's
    input (``hp_tensor_to_float8_dynamic``), or None where torchao is not installed."""
    try:
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig
    except ImportError:
        return None
    config = LinearMMConfig()
    return lambda: hp_tensor_to_float8_dynamic(t, torch.float8_e4m3fn, config)


def _skipped(func) -> bool:
    name = func.overloadpacket.__name__
    return (
        func.is_view
        or name in SKIPPED
        or "scaled_dot_product" in name
        or "flash_attention" in name
        or func.namespace != "aten"
    )


class OpCount(TorchDispatchMode):
    """Bytes read and written and kernels of the memory-bound ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.bytes = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _skipped(func):
            tensors = [
                t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)
            ]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.kernels += 1
        return out


def _model(preset: str, width: int, layers: int, seq: int, mode: str):
    from dtrain.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.from_preset(
        preset,
        # the CPU's rms_norm is composite (a dozen ops), CUDA's one fused kernel each way that moves
        # LayerNorm's bytes (no bias: the presets with RMSNorm have none): counted as LayerNorm
        norm="layernorm",
        d_model=width,
        n_head=4,
        n_kv_head=4,
        n_layer=layers,
        seq_len=seq,
        vocab_size=VOCAB,
    )
    model = GPT(cfg)
    return model.to(torch.bfloat16) if mode == "bf16" else model


def step_count(preset: str, width: int, layers: int, seq: int, mode: str) -> tuple[int, int]:
    """(bytes, kernels) of one forward and backward of the whole model."""
    model = _model(preset, width, layers, seq, mode)
    x = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(0))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else nullcontext()
    with OpCount() as count:
        with amp:
            loss = model(x, x)
        loss.backward()
    return count.bytes, count.kernels


def per_token_layer(preset: str, width: int, mode: str) -> dict[str, float]:
    """The blocks' memory-bound bytes per token and layer (in units of ``width``) and kernels per
    layer and micro-batch, from the double difference over ``DEPTHS`` x ``SEQS``."""
    (l0, l1), (s0, s1) = DEPTHS, SEQS
    got = {(n, s): step_count(preset, width, n, s, mode) for n in DEPTHS for s in SEQS}
    nbytes = got[l1, s1][0] - got[l0, s1][0] - got[l1, s0][0] + got[l0, s0][0]
    kernels = (got[l1, s0][1] - got[l0, s0][1]) / (l1 - l0)
    return {
        "bytes_per_d": nbytes / ((l1 - l0) * BATCH * (s1 - s0) * width),
        "kernels_per_layer": kernels,
    }


def count(preset: str, width: int) -> dict:
    out = {m: per_token_layer(preset, width, m) for m in MODES}
    ratio = out["bf16"]["bytes_per_d"] / out["autocast"]["bytes_per_d"]
    return {"preset": preset, "width": width, **out, "bf16_over_autocast_bytes": ratio}


def main(argv: list[str] | None = None) -> int:
    from dtrain.cli.main import OneLineParser
    from dtrain.core.errors import UserError, fail
    from dtrain.model.args import PRESETS

    p = OneLineParser(prog="python -m dtrain.gpucheck.eager_bytes", description=__doc__)
    p.add_argument("--preset", default="125m", help=f"dtrain's GPT preset: {', '.join(PRESETS)}")
    p.add_argument("--width", type=int, default=256, help="d_model counted (a multiple of 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        a = p.parse_args(argv)
        if a.preset not in PRESETS:
            raise UserError(f"--preset {a.preset}: choose one of {', '.join(PRESETS)}")
        if a.width < 4 or a.width % 4:  # 4 heads
            raise UserError(f"--width {a.width}: give a positive multiple of 4 (the model's heads)")
    except UserError as e:
        fail(str(e))
    got = count(a.preset, a.width)
    if a.json:
        print(json.dumps(got))
        return 0
    for m in MODES:
        r = got[m]
        print(
            f"{a.preset} {m:8s}: {r['bytes_per_d']:.1f} x d_model bytes per token and layer, "
            f"{r['kernels_per_layer']:.0f} kernels per layer"
        )
    print(f"bf16 / autocast bytes: {got['bf16_over_autocast_bytes']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
