"""The FP8 recipes and what each refuses, without torch: `python -m fp8_train` checks these
before importing it (fp8_train.checks); fp8_train.backends builds the recipes and re-exports
these names."""

from __future__ import annotations

from dtrain.core.checks import integer_at_least, one_of
from dtrain.core.errors import UserError

HIGH = ("fp32", "bf16", "fp16")
EMULATED = ("emulated_delayed", "emulated_current", "emulated_nvfp4", "emulated_mxfp4")
TORCHAO = ("torchao_tensorwise", "torchao_rowwise")
TE = ("te_delayed", "te_current", "te_block", "te_mxfp8")
RECIPES = HIGH + EMULATED + TORCHAO + TE


def backend_of(recipe: str) -> str:
    """none | emulated | torchao | te"""
    return "none" if recipe in HIGH else recipe.split("_", 1)[0]


def shape_multiple(recipe: str) -> int:
    """Both dims of an FP8/FP4 linear must be multiples of this (GEMM tiles, FP4 block sizes)."""
    return 32 if recipe == "emulated_mxfp4" or recipe == "te_mxfp8" else 16


def check_run(recipe: str, micro_batch: int, seq_len: int, activation_checkpointing: str) -> None:
    """What real FP8 kernels refuse mid-run, refused before the run starts."""
    backend = backend_of(recipe)
    if backend == "te" and activation_checkpointing != "none":
        raise UserError(
            f"train.activation_checkpointing={activation_checkpointing} with recipe={recipe}: "
            "TE's FP8 state needs TE's own checkpoint (te.checkpoint), which is not wired in "
            "here: use train.activation_checkpointing=none, or an emulated_* / torchao_* recipe"
        )
    tokens, multiple = micro_batch * seq_len, shape_multiple(recipe)
    if (
        backend in ("te", "torchao") and tokens % multiple
    ):  # FP8 GEMMs (TE, torch._scaled_mm) tile by 16
        raise UserError(
            f"recipe={recipe}: FP8 GEMMs need the tokens per micro-batch (train.micro_batch x "
            f"seq_len = {micro_batch} x {seq_len} = {tokens}) to be a multiple of {multiple}: "
            "change train.micro_batch or model.seq_len"
        )


def check_fp8_cfg(fp8) -> None:
    """The `fp8:` keys, checked before a rank starts (amax_history_len=0 would fail deep in a
    rank)."""
    for key, low in (("amax_history_len", 1), ("margin", 0)):
        integer_at_least(f"fp8.{key}", fp8[key], low)
    choices = {
        "amax_compute_algo": ("max", "most_recent"),
        "e5m2_overflow": ("saturate", "inf"),
        "torchao_emulate": ("auto", True, False),
    }
    for key, allowed in choices.items():
        one_of(f"fp8.{key}", fp8[key], allowed)
    scale = fp8.fp16_init_scale
    if (
        not isinstance(scale, (int, float))
        or isinstance(scale, bool)
        or not 0 < scale < float("inf")
    ):
        raise UserError(f"fp8.fp16_init_scale={scale!r} must be a finite number > 0")
