"""One switch, `recipe=`, picks the numerics of a run:

    fp32 | bf16          high-precision baselines (bf16 on GPU, fp32 on CPU where bf16 matmuls
                         crawl)
    fp16                 fp16 autocast + dynamic loss scaling (torch.amp.GradScaler)
    emulated_delayed     our fake-quant FP8 Linear, delayed scaling (amax history + margin)
    emulated_current     our fake-quant FP8 Linear, current scaling
    emulated_nvfp4       our fake-quant FP4 Linear, NVFP4 blocks     (stretch)
    emulated_mxfp4       our fake-quant FP4 Linear, MXFP4 blocks     (stretch)
    torchao_tensorwise   torchao float8 training, one scale per tensor (runs on CPU too)
    torchao_rowwise      torchao float8 training, one scale per row    (runs on CPU too)
    te_delayed | te_current | te_block | te_mxfp8   TransformerEngine te.Linear + te.autocast (GPU
                                                    only)

FP8 recipes keep everything that is not an FP8 linear in `train.precision` (auto: bf16 on GPU, fp32
on CPU). TransformerEngine and torchao are imported only when asked for; a missing one is one clear
error line. See te_backend.py for the TransformerEngine glue.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn as nn

from dtrain.core.checks import one_of
from dtrain.core.errors import UserError, missing_dependency
from dtrain.model.gpt import default_linear
from fp8_train.recipes import HIGH, RECIPES, backend_of


def high_precision(recipe: str, precision: str, device: torch.device) -> str:
    """The dtype of everything that is not an FP8 linear."""
    if recipe in HIGH:
        return recipe
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


@dataclass
class Numerics:
    """What the Trainer needs for one recipe."""

    recipe: str
    backend: str
    precision: str  # fp32 | bf16 | fp16: the non-FP8 dtype
    fp8_linear: Callable | None = None  # (name, in, out, bias) -> module, None for baselines
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None
    grad_scaler: object | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def train_precision(self) -> str:
        return "bf16" if self.precision == "bf16" else "fp32"


def check(recipe: str, device_type: str) -> None:
    """Fail before any rank starts when the recipe cannot run here."""
    one_of("recipe", recipe, RECIPES)
    if backend_of(recipe) == "torchao":
        _import_torchao()
    if backend_of(recipe) == "te":
        from fp8_train import te_backend

        te_backend.check_available(recipe, device_type)


def _import_torchao():
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise missing_dependency("torchao", "fp8", "recipe=torchao_*") from None
        raise UserError(
            f"torchao is installed but its float8 training does not import ({e}): install the "
            f"torchao release made for torch {torch.__version__.split('+')[0]}"
        ) from None
    return Float8LinearConfig, Float8Linear


def emulated_linear(recipe: str, fp8_cfg) -> Callable:
    """fp8.e5m2_overflow: `saturate` clamps gradients at +-57344 like the hardware's saturating
    conversion that TE's cast kernels use; `inf` keeps E5M2's IEEE overflow (torch's plain cast),
    which shows how a delayed scale that lags a growing gradient turns into NaNs."""
    from dataclasses import replace

    from fp8_train.emulated import FP8Linear
    from fp8_train.formats import E5M2

    one_of("fp8.e5m2_overflow", fp8_cfg.e5m2_overflow, ("saturate", "inf"))
    bwd = replace(E5M2, saturate=fp8_cfg.e5m2_overflow == "saturate")
    scaling = recipe.split("_", 1)[1]
    return lambda name, i, o, bias: FP8Linear(
        i,
        o,
        bias,
        scaling=scaling,
        margin=fp8_cfg.margin,
        history_len=fp8_cfg.amax_history_len,
        amax_algo=fp8_cfg.amax_compute_algo,
        bwd_format=bwd,
    )


def torchao_linear(recipe: str, emulate: bool) -> Callable:
    """emulate=True: torchao's own casts and scales, the GEMM in high precision on the dequantized
    operands (torchao's `emulate` flag). On CPU aten::_scaled_mm is a reference kernel ~1000x
    slower than an fp32 matmul (measured: 1.7 s vs 1.2 ms for 512x64x256), so CPU runs emulate."""
    from dataclasses import replace

    Float8LinearConfig, Float8Linear = _import_torchao()
    config = replace(Float8LinearConfig.from_recipe_name(recipe.split("_", 1)[1]), emulate=emulate)

    def make(name, i, o, bias):
        return Float8Linear.from_float(nn.Linear(i, o, bias=bias), config=config)

    return make


def build(recipe: str, precision: str, fp8_cfg, device: torch.device) -> Numerics:
    check(recipe, device.type)
    backend = backend_of(recipe)
    hp = high_precision(recipe, precision, device)
    n = Numerics(recipe, backend, hp)
    if hp == "fp16":
        n.autocast = partial(torch.autocast, device.type, dtype=torch.float16)
        n.grad_scaler = torch.amp.GradScaler(device.type, init_scale=fp8_cfg.fp16_init_scale)
    if backend == "emulated":
        n.fp8_linear = emulated_linear(recipe, fp8_cfg)
    elif backend == "torchao":
        emulate = (
            device.type == "cpu"
            if fp8_cfg.torchao_emulate == "auto"
            else bool(fp8_cfg.torchao_emulate)
        )
        n.fp8_linear = torchao_linear(recipe, emulate)
        if emulate:
            n.notes.append(
                "torchao emulate=True: torchao's FP8 casts and scales, GEMMs in high precision"
            )
    elif backend == "te":
        from fp8_train import te_backend

        n.fp8_linear = te_backend.linear_factory(device)
        n.autocast = te_backend.autocast_factory(recipe, fp8_cfg, hp, device)
    return n


def high_linear(name: str, i: int, o: int, bias: bool) -> nn.Module:
    return default_linear(name, i, o, bias)


def to_high_precision(module: nn.Module) -> bool:
    """Make one FP8 linear compute in high precision from now on (recovery ladder, last rung).

    Parameters stay the same objects, so DDP buckets and FSDP2's parameter groups are untouched.
    Returns False for modules we cannot switch (TransformerEngine's)."""
    from fp8_train.emulated import FP8Linear

    if isinstance(module, FP8Linear):
        module.fp8_enabled = False
        return True
    if (
        type(module).__name__ == "Float8Linear"
    ):  # torchao: run nn.Linear's forward on the same weight
        module.forward = nn.Linear.forward.__get__(module)
        return True
    return False
