"""The typed config nodes every subproject shares, and their registration with Hydra.

Each subproject's config is one dataclass (`<pkg>/conf/__init__.py`) that extends `BaseConfig`
and uses the shared nodes below; its `conf/config.yaml` only names that dataclass (stored in
Hydra's ConfigStore as `<pkg>_schema`) and the run-directory settings, so every default lives in
a dataclass. Hydra checks overrides against the types at composition: an unknown key or a value
of the wrong type is one `error:` line (dtrain.run.precheck) before anything starts.

One vocabulary across the experiments:

    model.preset + model.<GPTConfig field>   the model (null = the preset's value)
    model.seq_len                            sequence length
    train.micro_batch                        sequences per rank per (micro-)step
    train.precision                          compute precision: fp32 | bf16 (| auto in trainers)
    train.tp, train.sequence_parallel        tensor parallelism (tp-attention: lists, each measured)
    train.cp, train.cp_impl                  context parallelism (tp-attention's CP study: lists)
    model.moe.*, train.ep, train.etp         mixture of experts, expert parallelism (trainers)
    timing_warmup, iters                     untimed warm-up steps, timed steps
    profile.enabled, profile.steps           the torch.profiler window
    debug.*                                  test aids that fake a condition (allreduce-bench);
                                             fp8-train's FP8 debug tool is `fp8_debug.*`

Renamed keys are refused with the new name (each conf module's `RENAMED`, checked by
dtrain.run.precheck).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from dtrain.core.errors import UserError, unknown_key
from dtrain.model.moe_args import MoEArgs


@dataclass
class SlurmConfig:
    """Used when launcher=slurm (single runs); sweeps use hydra/launcher=submitit_slurm."""

    nodes: int = 1
    tasks_per_node: Optional[int] = None  # null = world_size / nodes (one task per GPU)
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: Optional[int] = None
    time_min: int = 30
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    additional: dict[str, Any] = field(
        default_factory=dict
    )  # extra sbatch options, e.g. {exclusive: true}
    # preempted or at the time limit: save a checkpoint, requeue, resume in the same run dir
    requeue: bool = True
    signal_delay_s: int = (
        60  # USR2 this many seconds before the time limit (a training step + a save must fit)
    )
    max_requeues: int = (
        3  # requeues after a time limit (submitit max_num_timeout); preemptions do not count
    )


@dataclass
class BaseConfig:
    """The keys every subproject has: `python -m tp_attention world_size=2
    results_dir=runs/try1`."""

    subproject: str = "dtrain"
    launcher: str = "auto"  # auto | local | slurm   (auto: this rank if inside a job, else local)
    world_size: int = 2  # ranks; on Slurm = nodes x tasks_per_node
    backend: str = "auto"  # auto | nccl | gloo      (auto: nccl when every rank has a GPU)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    results_dir: str = "results"  # run dirs land in <results_dir>/<subproject>/<run-id>/
    dist_timeout_s: float = (
        300  # collective timeout: a failed peer stops the others within this bound
    )
    heartbeat_timeout_s: Optional[float] = (
        120  # a silent rank is named and the run stopped; null = off
    )
    threads_per_rank: Optional[int] = None  # CPU threads per rank; null = cores / local ranks
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class ModelConfig:
    """One node in every experiment that builds dtrain's GPT: a preset and the fields to change.
    Every field but `preset` is a `dtrain.model.args.GPTConfig` field; null keeps the preset's
    value."""

    preset: str = "small"  # tiny | small | 125m | 350m | 1b | 7b (dtrain.model.args.PRESETS)
    seq_len: Optional[int] = None  # activation memory grows with it
    n_layer: Optional[int] = None
    d_model: Optional[int] = None
    n_head: Optional[int] = None
    n_kv_head: Optional[int] = None  # fewer than n_head = grouped-query attention
    mlp_ratio: Optional[int] = None
    vocab_size: Optional[int] = None
    norm: Optional[str] = None  # rmsnorm | layernorm
    bias: Optional[bool] = None
    tie_embeddings: Optional[bool] = None
    init_std: Optional[float] = None
    moe: MoEArgs = field(default_factory=MoEArgs)  # model.moe.experts > 0: MoE feed-forwards

    def __post_init__(self):
        if isinstance(self.moe, dict):  # node(): a plain dict from OmegaConf
            known = [f.name for f in fields(MoEArgs)]
            unknown = sorted(set(self.moe) - set(known))
            if unknown:
                raise UserError(
                    unknown_key(
                        f"model.moe.{unknown[0]}", known, every=[f"model.moe.{k}" for k in known]
                    )
                )
            self.moe = MoEArgs(**self.moe)

    def overrides(self) -> dict:
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("preset", "moe") and getattr(self, f.name) is not None
        }
        if self.moe.experts:  # experts=0 (the default) is the dense model
            out["moe"] = self.moe
        return out

    def build(self):
        """The dtrain.model.args.GPTConfig, checked as one whole model (UserError when it cannot
        be)."""
        from dtrain.core.checks import check_model_values
        from dtrain.model.args import GPTConfig

        try:
            model = GPTConfig.from_preset(self.preset, **self.overrides())
        except (ValueError, TypeError) as e:
            raise UserError(f"model: {e}") from None
        check_model_values(model)  # builds, but cannot train (vocab_size=1, init_std=nan)
        return model


@dataclass
class ProfileConfig:
    """torch.profiler over a few steps, right after the timing warm-up (left out of step
    statistics)."""

    enabled: bool = True
    steps: int = 2


def node(cls, value):
    """A typed node (dataclass instance) from an OmegaConf node, a dict or an instance."""
    from omegaconf import OmegaConf

    if isinstance(value, cls):
        return value
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value or {}) - known)
    if unknown:
        raise UserError(unknown_key(unknown[0], sorted(known)))
    return cls(**(value or {}))


def model_config(value):
    """The GPTConfig of a `model:` node (OmegaConf node, dict or ModelConfig)."""
    return node(ModelConfig, value).build()


def defaults(cls):
    """The defaults of a config dataclass as a plain OmegaConf node (untyped, open to new keys):
    what a run with no overrides sees, for code that builds a config without Hydra (tests,
    tools)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(cls)))


def register(name: str, cls) -> None:
    """Store `cls` in Hydra's ConfigStore as `name` (a config.yaml names it in its defaults
    list)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=cls)


# Old key -> new key. Each subproject's conf module has a `RENAMED` table (these shared ones
# included); an override of an old key is refused naming the new one (dtrain.run.precheck).
RENAMED_TRAIN = {"train.mixed_precision": "train.precision"}
RENAMED_MODEL = {"model.overrides": "model.<field>, e.g. model.n_layer=4"}


def renamed_key(key: str, renamed: dict[str, str]) -> str | None:
    """The new name of `key` (or of a node above it) when it was renamed, else None."""
    key = key.lstrip("+~").split("=", 1)[0]
    for old, new in renamed.items():
        if key == old or key.startswith(old + "."):
            return new if "," in new else new + key[len(old) :]  # debug.freq -> fp8_debug.freq
    return None
