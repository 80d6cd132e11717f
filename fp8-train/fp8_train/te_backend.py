"""TransformerEngine glue, deliberately thin: te.Linear through the model's linear hook, and
te.autocast (te.fp8_autocast before TE 2.x) with one of its recipes around every forward.

    te_delayed  recipe.DelayedScaling(fp8_format=HYBRID, margin, amax_history_len, amax_compute_algo)
    te_current  recipe.Float8CurrentScaling(fp8_format=HYBRID)
    te_block    recipe.Float8BlockScaling()     (Hopper and newer)
    te_mxfp8    recipe.MXFP8BlockScaling()      (Blackwell: compute capability >= 10.0)

HYBRID = E4M3 forward, E5M2 backward, like our emulated recipe. LayerNormLinear is not swapped
in: the GPT's norms feed three separate projections (wq, wk, wv) and the model hook builds one
linear at a time, so fusing norm + linear would need a QKV-fused model.
Nothing here runs without a GPU; tests drive it with a stand-in `transformer_engine` module.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from dtrain.errors import UserError, missing_dependency

# recipe -> (TE recipe class, minimum CUDA compute capability)
TE_RECIPES = {"te_delayed": ("DelayedScaling", (8, 9)), "te_current": ("Float8CurrentScaling", (8, 9)),
              "te_block": ("Float8BlockScaling", (9, 0)), "te_mxfp8": ("MXFP8BlockScaling", (10, 0))}


def _import_te():
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except ImportError:
        raise missing_dependency("transformer_engine", "gpu", "recipe=te_*") from None
    return te, te_recipe


def check_available(recipe: str, device_type: str) -> None:
    """TE needs the package and a CUDA GPU recent enough for the recipe."""
    if device_type != "cuda" or not torch.cuda.is_available():
        raise UserError(f"recipe={recipe} uses TransformerEngine, which needs a CUDA GPU (none here): "
                        "use recipe=emulated_delayed or torchao_tensorwise on CPU")
    _import_te()
    need = TE_RECIPES[recipe][1]
    have = torch.cuda.get_device_capability()
    if have < need:
        raise UserError(f"recipe={recipe} needs compute capability >= {need[0]}.{need[1]}, this GPU has "
                        f"{have[0]}.{have[1]}: pick te_delayed or te_current (Ada/Hopper) or a non-TE recipe")


def make_recipe(recipe: str, fp8_cfg):
    _, te_recipe = _import_te()
    cls = getattr(te_recipe, TE_RECIPES[recipe][0])
    if recipe == "te_delayed":
        return cls(margin=fp8_cfg.margin, fp8_format=te_recipe.Format.HYBRID,
                   amax_history_len=fp8_cfg.amax_history_len, amax_compute_algo=fp8_cfg.amax_compute_algo)
    if recipe == "te_current":
        return cls(fp8_format=te_recipe.Format.HYBRID)
    return cls()


def linear_factory(device: torch.device) -> Callable:
    te, _ = _import_te()

    def make(name, in_features, out_features, bias):
        return te.Linear(in_features, out_features, bias=bias, params_dtype=torch.float32, device=device)

    return make


def autocast_factory(recipe: str, fp8_cfg, precision: str, device: torch.device) -> Callable:
    """A context for each forward: TE's FP8 autocast, inside torch bf16 autocast when asked."""
    te, _ = _import_te()
    te_recipe = make_recipe(recipe, fp8_cfg)
    enter_fp8 = (lambda: te.autocast(enabled=True, recipe=te_recipe)) if hasattr(te, "autocast") else \
        (lambda: te.fp8_autocast(enabled=True, fp8_recipe=te_recipe))

    @contextlib.contextmanager
    def fp8_context():
        with contextlib.ExitStack() as stack:
            if precision == "bf16":
                stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
            stack.enter_context(enter_fp8())
            yield

    return fp8_context
