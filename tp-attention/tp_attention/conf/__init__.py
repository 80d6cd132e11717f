"""tp-attention's typed configs: every default of `python -m tp_attention`, of
`python -m tp_attention.parity` and of the context-parallel study `python -m tp_attention.cp`
(conf/config.yaml, parity.yaml and cp.yaml only name them).

The benchmark's default is small enough for a 2-core CPU (world_size=2, gloo) in ~30 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dtrain.core.nodes import RENAMED_MODEL, BaseConfig, ModelConfig, ProfileConfig, register
from dtrain.parallel.feasibility import OWN_CP_IMPLS
from dtrain.train import TrainConfig


@dataclass
class TpLayerTrainConfig:
    """The trainer's keys (dtrain.train.TrainConfig: same names, meanings and defaults) that one
    measured TP layer takes; tp and sequence_parallel may be lists, each value measured in the
    run."""

    micro_batch: int = TrainConfig.micro_batch  # sequences in the measured forward+backward
    precision: str = (
        TrainConfig.precision
    )  # fp32 | bf16 (weights and activations; bf16 is for GPUs)
    tp: Any = None  # int or list of TP degrees measured in this run; null = world_size
    sequence_parallel: Any = field(default_factory=lambda: [False, True])  # bool or list
    # false: the trainer's layout (separate wq, wk, wv sharing one entry; its checkpoints keep the
    # model's names); true: one column-parallel GEMM for q, k, v (this benchmark only)
    fused_qkv: bool = False


@dataclass
class TpAttentionConfig(BaseConfig):
    subproject: str = "tp-attention"
    train: TpLayerTrainConfig = field(default_factory=TpLayerTrainConfig)
    module: str = "block"  # block (attention + MLP, 2 TP regions) | attention
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(preset="small")
    )  # one block of it:
    #                                   seq_len, d_model, n_head, n_kv_head (< tp replicates k/v
    #                                   heads), mlp_ratio, norm, bias
    impls: Any = field(
        default_factory=lambda: ["single", "handrolled", "handrolled_async", "dtensor"]
    )
    timing_warmup: int = 3  # untimed steps before the timed ones
    iters: int = 10  # timed steps
    profile: ProfileConfig = field(
        default_factory=lambda: ProfileConfig(enabled=True, steps=3)
    )  # comm share


@dataclass
class TpParityTrainConfig:
    tp: Any = field(
        default_factory=lambda: [1, 2, 4]
    )  # every degree is checked in the same process group


@dataclass
class TpParityConfig(BaseConfig):
    subproject: str = "tp-attention-parity"
    world_size: int = (
        4  # 4 ranks oversubscribed on a 2-core CPU is fine: this checks, it does not time
    )
    train: TpParityTrainConfig = field(default_factory=TpParityTrainConfig)
    cases_per_layout: int = 1  # random cases per (tp, head layout, SP on/off)
    rtol: float = 1.0e-5  # max|tp - ref| / max|ref| per tensor (fp32)


@dataclass
class CpStudyTrainConfig:
    """The trainer's names (dtrain.train.TrainConfig) for what one measured CP layer takes; cp and
    cp_impl are lists here, each value measured in the run."""

    micro_batch: int = 1  # sequences in the measured forward+backward
    precision: str = (
        TrainConfig.precision
    )  # fp32 | bf16 (weights and activations; bf16 is for GPUs)
    cp: Any = None  # int or list of cp degrees (>= 2); null = world_size
    # dtrain's own implementations (PyTorch's context_parallel needs CUDA)
    cp_impl: Any = field(default_factory=lambda: list(OWN_CP_IMPLS))


@dataclass
class CpStudyModelConfig(ModelConfig):
    """The shared model node; seq_len may be a list here (each length measured). GQA by default."""

    seq_len: Any = field(default_factory=lambda: [256, 512, 1024])
    n_kv_head: Optional[int] = 2


@dataclass
class CpStudyConfig(BaseConfig):
    subproject: str = "tp-attention-cp"
    train: CpStudyTrainConfig = field(default_factory=CpStudyTrainConfig)
    model: CpStudyModelConfig = field(
        default_factory=CpStudyModelConfig
    )  # its attention layer is measured
    tp_sp: bool = True  # also measure TP with sequence parallelism at tp = cp (the alternative)
    timing_warmup: int = 2  # untimed steps before the timed ones
    iters: int = 5  # timed steps
    rtol: float = 1.0e-5  # parity of every measured layer with one device: max|cp - ref| / max|ref|


MODEL_KEYS = ("seq_len", "d_model", "n_head", "n_kv_head", "mlp_ratio", "norm", "bias")
TRAIN_KEYS = (
    "micro_batch",
    "precision",
    "tp",
    "sequence_parallel",
    "fused_qkv",
)  # the trainer's names
RENAMED = {
    **RENAMED_MODEL,
    "dtype": "train.precision",
    "seq": "model.seq_len",
    "batch": "train.micro_batch",
    "warmup": "timing_warmup",
    "profile_steps": "profile.steps",
    **{k: f"model.{k}" for k in MODEL_KEYS if k != "seq_len"},
    **{k: f"train.{k}" for k in TRAIN_KEYS},
}
register("tp_attention_schema", TpAttentionConfig)
register("tp_attention_parity_schema", TpParityConfig)
register("tp_attention_cp_schema", CpStudyConfig)
