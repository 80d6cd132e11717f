"""tp-attention's typed configs: every default of `python -m tp_attention` and of
`python -m tp_attention.parity` (conf/config.yaml and conf/parity.yaml only name them).

The benchmark's default is small enough for a 2-core CPU (world_size=2, gloo) in ~30 s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtrain.config import RENAMED_MODEL, BaseConfig, ModelConfig, ProfileConfig, register


@dataclass
class TpAttentionConfig(BaseConfig):
    subproject: str = "tp-attention"
    tp: Any = None                    # int or list of TP degrees measured in this run; null = world_size
    sequence_parallel: Any = field(default_factory=lambda: [False, True])  # bool or list
    module: str = "block"             # block (attention + MLP, 2 TP regions) | attention
    micro_batch: int = 4              # sequences in the measured forward+backward
    model: ModelConfig = field(default_factory=lambda: ModelConfig(preset="small"))  # one block of it:
    #                                   seq_len, d_model, n_head, n_kv_head (< tp replicates k/v heads), mlp_ratio, norm, bias
    fused_qkv: bool = True            # one column-parallel GEMM for q, k, v (false: three, sharing one entry)
    precision: str = "fp32"           # fp32 | bf16 (weights and activations; bf16 is for GPUs)
    impls: Any = field(default_factory=lambda: ["single", "handrolled", "handrolled_async", "dtensor"])
    timing_warmup: int = 3            # untimed steps before the timed ones
    iters: int = 10                   # timed steps
    profile: ProfileConfig = field(default_factory=lambda: ProfileConfig(enabled=True, steps=3))  # comm share


@dataclass
class TpParityConfig(BaseConfig):
    subproject: str = "tp-attention-parity"
    world_size: int = 4               # 4 ranks oversubscribed on a 2-core CPU is fine: this checks, it does not time
    tp: Any = field(default_factory=lambda: [1, 2, 4])  # every degree is checked in the same process group
    cases_per_layout: int = 1         # random cases per (tp, head layout, SP on/off)
    rtol: float = 1.0e-5              # max|tp - ref| / max|ref| per tensor (fp32)


MODEL_KEYS = ("seq_len", "d_model", "n_head", "n_kv_head", "mlp_ratio", "norm", "bias")
RENAMED = {**RENAMED_MODEL, "dtype": "precision", "seq": "model.seq_len", "batch": "micro_batch",
           "warmup": "timing_warmup", "profile_steps": "profile.steps",
           **{k: f"model.{k}" for k in MODEL_KEYS if k != "seq_len"}}
register("tp_attention_schema", TpAttentionConfig)
register("tp_attention_parity_schema", TpParityConfig)
