"""TransformerEngine glue, deliberately thin: te.Linear through the model's linear hook, and
te.autocast (te.fp8_autocast before TE 2.x) with one of its recipes around every forward.

    te_delayed  recipe.DelayedScaling(fp8_format=HYBRID, margin, amax_history_len,
    amax_compute_algo) te_current  recipe.Float8CurrentScaling(fp8_format=HYBRID)
    te_block    recipe.Float8BlockScaling()     (Hopper and newer)
    te_mxfp8    recipe.MXFP8BlockScaling()      (Blackwell: compute capability >= 10.0)

HYBRID = E4M3 forward, E5M2 backward, like our emulated recipe. LayerNormLinear is not swapped
in: the GPT's norms feed three separate projections (wq, wk, wv) and the model hook builds one
linear at a time, so fusing norm + linear would need a QKV-fused model.
Checks, in the launching process (fp8_train.checks.validate) before any rank starts:
  - TE is importable: "not installed" only when there is no `transformer_engine` package; a package
    that fails to import (built against another torch, missing CUDA libraries) reports that error.
  - TE >= 2.3 (MIN_VERSION: Float8CurrentScaling and Float8BlockScaling in the stable recipe API).
  - TE's own availability check for the recipe on this GPU/CUDA (is_fp8_available,
    is_fp8_block_scaling_available, is_mxfp8_available with return_reason=True; TE releases
    before they were exported at the top level have the same checks in
    transformer_engine.pytorch.fp8).
  - activation checkpointing is refused (recipes.check_run): TE's FP8 state needs TE's own
    checkpoint (te.checkpoint), which the shared parallelize step does not wire in.
  - FP8 GEMM shapes (recipes.check_run): tokens per micro-batch a multiple of 16 (32 for MXFP8);
    linear dims that are not fall back to high precision in the precision map.
Nothing here runs without a GPU; tests drive it with a stand-in `transformer_engine` module.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from typing import Callable

import torch

from dtrain.core.errors import UserError

MIN_VERSION = (2, 3)
INSTALL = (
    "pip install --no-build-isolation 'transformer_engine[pytorch]>=2.3' (builds against the "
    "installed torch)"
)

# recipe -> (TE recipe class, TE availability check)
TE_RECIPES = {
    "te_delayed": ("DelayedScaling", "is_fp8_available"),
    "te_current": ("Float8CurrentScaling", "is_fp8_available"),
    "te_block": ("Float8BlockScaling", "is_fp8_block_scaling_available"),
    "te_mxfp8": ("MXFP8BlockScaling", "is_mxfp8_available"),
}
# the same checks before TE exported them at the top level: transformer_engine.pytorch.fp8.<name>()
_LEGACY_CHECKS = {
    "is_fp8_available": "check_fp8_support",
    "is_fp8_block_scaling_available": "check_fp8_block_scaling_support",
    "is_mxfp8_available": "check_mxfp8_support",
}


def _import_te():
    """(te.pytorch, te.common.recipe); a one-line UserError with the real cause otherwise."""
    if not _installed("transformer_engine"):
        raise UserError(f"recipe=te_* needs TransformerEngine, which is not installed: {INSTALL}")
    try:
        te = importlib.import_module("transformer_engine.pytorch")
        te_recipe = importlib.import_module("transformer_engine.common.recipe")
    except Exception as e:  # noqa: BLE001
        # an ABI mismatch is an OSError/ImportError/RuntimeError/AssertionError
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(
            f"TransformerEngine is installed but does not import ({type(e).__name__}: {cause}); "
            f"it must be built against this torch {torch.__version__}: {INSTALL}"
        ) from None
    return te, te_recipe


def _installed(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def te_version() -> tuple[int, ...]:
    import transformer_engine

    numbers = re.findall(r"\d+", str(getattr(transformer_engine, "__version__", "0")))[:2]
    return tuple(int(n) for n in numbers)


def recipe_available(te, recipe: str) -> tuple[bool, str]:
    """TE's own answer (and its reason) for whether `recipe` runs on this GPU and CUDA."""
    name = TE_RECIPES[recipe][1]
    check = getattr(te, name, None)
    if check is not None:
        return check(return_reason=True)
    legacy = importlib.import_module("transformer_engine.pytorch.fp8")
    return getattr(legacy, _LEGACY_CHECKS[name])()


def check_available(recipe: str, device_type: str) -> None:
    """TE needs a CUDA GPU, an importable TE >= 2.3, and TE's yes for the recipe here."""
    if device_type != "cuda" or not torch.cuda.is_available():
        raise UserError(
            f"recipe={recipe} uses TransformerEngine, which needs a CUDA GPU (none here): "
            "use recipe=emulated_delayed or torchao_tensorwise on CPU"
        )
    te, _ = _import_te()
    version = te_version()
    if version < MIN_VERSION:
        found = ".".join(map(str, version))
        raise UserError(f"recipe={recipe} needs TransformerEngine >= 2.3, found {found}: {INSTALL}")
    ok, reason = recipe_available(te, recipe)
    if not ok:
        cc = ".".join(map(str, torch.cuda.get_device_capability()))
        raise UserError(
            f"recipe={recipe} is not supported on this GPU (compute capability {cc}, CUDA "
            f"{torch.version.cuda}): {reason.strip() or 'TransformerEngine says no'} - te_delayed "
            "/ te_current need cc >= 8.9, te_block Hopper + CUDA >= 12.9, te_mxfp8 Blackwell"
        )


def make_recipe(recipe: str, fp8_cfg):
    _, te_recipe = _import_te()
    cls = getattr(te_recipe, TE_RECIPES[recipe][0])
    if recipe == "te_delayed":
        return cls(
            margin=fp8_cfg.margin,
            fp8_format=te_recipe.Format.HYBRID,
            amax_history_len=fp8_cfg.amax_history_len,
            amax_compute_algo=fp8_cfg.amax_compute_algo,
        )
    if recipe == "te_current":
        return cls(fp8_format=te_recipe.Format.HYBRID)
    return cls()


def linear_factory(device: torch.device) -> Callable:
    te, _ = _import_te()

    def make(name, in_features, out_features, bias):
        return te.Linear(
            in_features, out_features, bias=bias, params_dtype=torch.float32, device=device
        )

    return make


def autocast_factory(recipe: str, fp8_cfg, precision: str, device: torch.device) -> Callable:
    """A context for each forward: TE's FP8 autocast, inside torch bf16 autocast when asked."""
    te, _ = _import_te()
    te_recipe = make_recipe(recipe, fp8_cfg)
    enter_fp8 = (
        (lambda: te.autocast(enabled=True, recipe=te_recipe))
        if hasattr(te, "autocast")
        else (lambda: te.fp8_autocast(enabled=True, fp8_recipe=te_recipe))
    )

    @contextlib.contextmanager
    def fp8_context():
        with contextlib.ExitStack() as stack:
            if precision == "bf16":
                stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
            stack.enter_context(enter_fp8())
            yield

    return fp8_context
