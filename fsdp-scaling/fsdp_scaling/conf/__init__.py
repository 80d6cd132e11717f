"""fsdp-scaling's typed config: every default of `python -m fsdp_scaling` (conf/config.yaml only
names it).

The default (small GPT, 2 ranks on CPU, 10 steps) takes ~15-25 s. Study sweeps:
fsdp-scaling/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from dtrain.core.nodes import (
    RENAMED_MODEL,
    RENAMED_TRAIN,
    BaseConfig,
    ModelConfig,
    ProfileConfig,
    register,
)
from dtrain.train import TrainConfig


def default_train() -> TrainConfig:
    return TrainConfig(
        steps=10,
        micro_batch=2,
        grad_accum=II("train.pp"),  # one micro-step per pipeline stage (1 without pp)
        prefetch=True,
        timing_warmup=3,
        log_every=0,
        dataset_tokens=200_000,
    )


@dataclass
class FsdpScalingConfig(BaseConfig):
    subproject: str = "fsdp-scaling"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(preset="small"))
    train: TrainConfig = field(default_factory=default_train)
    profile: ProfileConfig = field(default_factory=lambda: ProfileConfig(enabled=True, steps=2))


RENAMED = {**RENAMED_TRAIN, **RENAMED_MODEL}
register("fsdp_scaling_schema", FsdpScalingConfig)
