"""What `python -m fsdp_scaling` refuses before any rank starts (dtrain.run.app runs ``validate``
for every point of a sweep). Without torch at import: a wrong value is one line in a fraction of a
second; the device, memory
and checkpoint checks import it after the values pass (dtrain.train.run_checks)."""

from __future__ import annotations

from omegaconf import DictConfig

from dtrain.core.errors import UserError
from dtrain.train import run_checks


def validate(cfg: DictConfig) -> None:
    train, model = run_checks.check_values(cfg)
    if cfg.profile.enabled and cfg.profile.steps < 1:
        raise UserError(
            f"profile.steps={cfg.profile.steps} must be >= 1 (or profile.enabled=false)"
        )
    t = cfg.train
    if cfg.profile.enabled and t.timing_warmup + cfg.profile.steps >= t.steps:
        least = t.timing_warmup + cfg.profile.steps + 1  # warm-up, profiled steps, one timed step
        raise UserError(
            f"train.steps={t.steps} leaves no timed step after "
            f"train.timing_warmup={t.timing_warmup} and profile.steps={cfg.profile.steps}: "
            f"set train.steps>={least}, or lower train.timing_warmup or profile.steps, "
            "or profile.enabled=false"
        )
    run_checks.check_host(cfg, train, model, run_checks.local_device(cfg))
