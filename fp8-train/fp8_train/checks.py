"""What `python -m fp8_train` refuses before any rank starts (dtrain.run.app runs ``validate`` for
every point of a sweep). The values first, without torch (a wrong one is one line in a fraction of a
second); then what needs
torch: a local run's device and whether its recipe runs there, memory, a resume's checkpoint, the
precision map and the fault plan against the model's layers."""

from __future__ import annotations

import re

from omegaconf import DictConfig, OmegaConf

from dtrain.core.errors import UserError
from dtrain.train import run_checks
from fp8_train import recipes


def validate(cfg: DictConfig) -> None:
    if cfg.recipe not in recipes.RECIPES:
        raise UserError(
            f"recipe={cfg.recipe!r} is unknown: choose one of {', '.join(recipes.RECIPES)}"
        )
    recipes.check_fp8_cfg(cfg.fp8)
    train, model = run_checks.check_values(cfg)
    recipes.check_run(cfg.recipe, train.micro_batch, model.seq_len, train.activation_checkpointing)
    try:
        re.compile(cfg.fp8_debug.layers.layer_name_regex_pattern)
    except re.error as e:
        raise UserError(f"fp8_debug.layers.layer_name_regex_pattern is not a regex ({e})") from None
    if cfg.fp8_debug.freq < 0 or cfg.health.every < 1:
        raise UserError("fp8_debug.freq must be >= 0 and health.every >= 1")

    import torch

    from dtrain.model.gpt import GPT
    from fp8_train import backends, faults
    from fp8_train.precision_map import PrecisionMap, check_rules_match

    device = run_checks.local_device(cfg)
    if device is not None:  # on Slurm the compute nodes decide; ranks check again there
        backends.check(cfg.recipe, device.type)
    run_checks.check_host(cfg, train, model, device)
    PrecisionMap.from_cfg(cfg.precision_map, model)
    check_rules_match(cfg.precision_map, GPT.linear_names(model))
    with torch.device("meta"):
        names = {n for n, _ in GPT(model).named_modules()}
    faults.check(OmegaConf.to_container(cfg.faults, resolve=True), names)
