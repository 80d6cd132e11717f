"""fp8-train's typed config: every default of `python -m fp8_train` (conf/config.yaml only names
it).

The default is small: 2 CPU ranks, DDP, ~30 s. `inspect`'s thresholds default from InspectConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from dtrain.core.nodes import RENAMED_MODEL, RENAMED_TRAIN, BaseConfig, ModelConfig, register
from dtrain.train import TrainConfig


@dataclass
class Fp8Config:
    margin: int = 0
    amax_history_len: int = 16
    amax_compute_algo: str = "max"  # max | most_recent
    # saturate (as TE's cast kernels) | inf (IEEE overflow: lagging delayed scales -> NaN)
    e5m2_overflow: str = "saturate"
    fp16_init_scale: float = 65536.0
    # auto (true on CPU, where _scaled_mm is a ~1000x slower reference kernel) | true | false
    torchao_emulate: Any = "auto"


@dataclass
class PrecisionMapConfig:
    default: str = "fp8"
    keep_first_block: bool = False
    keep_last_block: bool = False
    keep_lm_head: bool = True  # the LM head's logits are the most range-hungry tensor
    rules: list[Any] = field(
        default_factory=list
    )  # [{pattern: "blocks.*.mlp.w2", precision: high}, ...]; first match wins


@dataclass
class LayerSelection:
    layer_name_regex_pattern: str = r"blocks\..*|lm_head"


@dataclass
class Fp8DebugConfig:
    """The FP8 debug tool (nvdlfw-inspect style selection); its records are `fp8_debug`."""

    enabled: bool = True
    freq: int = 10  # every N steps
    layers: LayerSelection = field(default_factory=LayerSelection)
    tensors: list[str] = field(default_factory=lambda: ["activation", "weight", "gradient"])
    recipes: list[str] = field(
        default_factory=lambda: ["delayed", "current"]
    )  # + mxfp8 | nvfp4 | mxfp4 ("as if" block-scaled)
    amax_history_len: int = II("fp8.amax_history_len")
    margin: int = II("fp8.margin")
    e5m2_overflow: str = II("fp8.e5m2_overflow")
    # underflow/mse/cos estimated on this many elements per tensor (0 = all); overflow exact
    sample_elements: int = 4096
    dump_tensors: bool = False


@dataclass
class InspectConfig:
    """Thresholds for `python -m fp8_train inspect RUN` (overridable there as key=value)."""

    mse_healthy: float = 1.0e-2
    mse_bad: float = 1.0e3
    underflow_bad_pct: float = 80.0
    overflow_bad_pct: float = 1.0
    cos_bad: float = 0.99
    top: int = 10


@dataclass
class GuardConfig:
    enabled: bool = True
    lr_cut_after: int = 2  # bad steps in a row before the LR is cut
    lr_cut_factor: float = 0.5
    lr_restore_after: int = 5  # clean steps in a row that undo one LR cut (0 = the cut stays)
    rollback_after: int = 3  # bad steps in a row before rolling back (0 = never)
    to_high_precision: bool = (
        True  # after a rollback, the offending layer computes in high precision
    )
    checkpoint_every: int = 20  # the guard's "last good" checkpoints (only after clean steps)
    max_rollbacks: int = 3
    report_params: int = 8


@dataclass
class HealthConfig:
    enabled: bool = True
    every: int = 5
    window: int = 10
    spike_z: float = 4.0
    plateau_rel: float = 0.005
    scale_jump: float = 16.0
    tensorboard: bool = True


def default_train() -> TrainConfig:
    return TrainConfig(
        steps=40,
        micro_batch=8,
        warmup_steps=4,
        strategy="ddp",
        log_every=10,
        timing_warmup=3,
        dataset_tokens=200_000,
        precision="auto",
    )  # non-FP8 parts: bf16 on GPU, fp32 on CPU (the fp32/bf16/fp16 recipes set it)


@dataclass
class Fp8TrainConfig(BaseConfig):
    subproject: str = "fp8-train"
    # fp32 | bf16 | fp16 | emulated_{delayed,current,nvfp4,mxfp4} | torchao_{tensorwise,rowwise} |
    # te_{delayed,current,block,mxfp8}
    recipe: str = "emulated_delayed"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(preset="tiny"))
    train: TrainConfig = field(default_factory=default_train)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    precision_map: PrecisionMapConfig = field(default_factory=PrecisionMapConfig)
    fp8_debug: Fp8DebugConfig = field(default_factory=Fp8DebugConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    faults: list[Any] = field(
        default_factory=list
    )  # [{step: 12, layer: blocks.1.mlp.w1, tensor: activation, kind: inf, repeat: 1}]
    health: HealthConfig = field(default_factory=HealthConfig)


RENAMED = {**RENAMED_TRAIN, **RENAMED_MODEL, "precision": "train.precision", "debug": "fp8_debug"}
register("fp8_train_schema", Fp8TrainConfig)
