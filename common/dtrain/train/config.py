"""TrainConfig: the `train:` node of a subproject's config, typed and checked.

Every problem with the node is a `UserError` that says what to change, raised before a rank
starts (`validate(world_size)`), so bad input is one line and exit code 2. `validate` only checks:
the values a run derives (grad_accum from global_batch, precision `auto` -> fp32 | bf16) are in
the copy `resolved` returns, never written back into the config the user asked for.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass, fields

from dtrain.core.errors import UserError, unknown_key

# STRATEGIES is re-exported for dtrain.train
from dtrain.core.layout import SHARDED, STRATEGIES, Layout, recompute_of, schedule_of  # noqa: F401

PRECISIONS = ("fp32", "bf16", "auto")
TP_IMPLS = (
    "handrolled",
    "dtensor",
)  # dtrain.parallel.tp (the study's subject) | parallelize_module
ACTIVATION_CHECKPOINTING = ("none", "op", "block")  # op: torchtitan's selective op AC


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "None": "null",
}


def _check_type(key: str, value, annotation: str) -> None:
    """`train.steps=abc` is one line, not a TypeError deep inside a rank."""
    names = [t.strip() for t in str(annotation).split("|")]
    if value is None and "None" in names:
        return
    allowed = tuple(t for n in names if n != "None" for t in _TYPES.get(n, (object,)))
    if not isinstance(value, allowed) or (isinstance(value, bool) and "bool" not in names):
        raise UserError(f"{key}={value!r} must be {' or '.join(_WORDS.get(n, n) for n in names)}")


@dataclass
class TrainConfig:
    steps: int = 20
    micro_batch: int = 4  # sequences per rank per micro-step
    grad_accum: int = (
        1  # micro-steps per optimizer step (a run derives it when global_batch is set)
    )
    global_batch: int | None = (
        None  # sequences per optimizer step; set it to hold it fixed across world sizes
    )
    lr: float = 3e-3
    warmup_steps: int = 2  # linear warmup, then cosine decay to min_lr at `steps`
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = 1.0  # max global grad norm; null = no clipping (norm still measured)
    strategy: str = "zero3"  # single | ddp | zero2 | zero3 | hsdp
    hsdp_replicate: int = (
        2  # hsdp: replica groups; each shards over dp / hsdp_replicate ranks (ParallelDims.of)
    )
    # fp32 | bf16 | auto (bf16 on GPU, fp32 on CPU); FSDP2: bf16 params, fp32 reduce; single/ddp:
    # autocast
    precision: str = "fp32"
    activation_checkpointing: str = "none"  # none | op | block
    tp: int = 1  # tensor-parallel degree
    # handrolled (Megatron blocks, dtrain.parallel.tp) | dtensor (parallelize_module)
    tp_impl: str = "handrolled"
    sequence_parallel: bool = False  # tp: activations between blocks sharded along the sequence
    # tp: overlap the input-grad all-reduce (reduce-scatter with SP) with the weight-grad GEMMs
    async_grad_allreduce: bool = False
    pp: int = 1  # pipeline stages over ranks; dp = world_size / (tp * pp * cp)
    cp: int = 1  # context parallelism: ranks sharing each sequence (dtrain.parallel.cp)
    cp_impl: str = (
        "auto"  # auto (torch on CUDA + NCCL, else ring) | ring | ulysses | torch (context_parallel)
    )
    ep: int = 1  # expert parallelism (MoE): ranks the experts split over, folded from shard x cp
    etp: int = 1  # expert tensor parallelism (only 1 runs)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | interleaved_zb | zbv
    pp_virtual: int = 1  # stages per pipeline rank (>= 2 for interleaved_*, 2 for zbv)
    prefetch: bool = False  # FSDP2 explicit forward/backward prefetch of the next block
    compile: bool = False  # torch.compile each block (after checkpointing, before sharding)
    timing_warmup: int = 2  # first steps left out of step-time statistics
    log_every: int = 10  # print a line every N steps (0 = never)
    checkpoint_every: int = 0  # save every N steps (0 = only when asked)
    checkpoint_dir: str | None = (
        None  # null = <run_dir>/checkpoints; else a new or empty folder this run claims
    )
    keep_checkpoints: int | None = (
        3  # newest step-N folders kept in the run's checkpoint_dir; null = all
    )
    resume_from: str | None = (
        None  # a step-N checkpoint folder, or a folder of them (latest is taken)
    )
    dataset: str = (
        "synthetic"  # "synthetic" (Markov corpus), a nanoGPT .bin file, or any file (bytes)
    )
    dataset_tokens: int = 500_000  # size of the synthetic corpus

    @classmethod
    def from_cfg(cls, node) -> "TrainConfig":
        """From a mapping (OmegaConf node or dict); unknown keys are an error, not ignored."""
        from omegaconf import OmegaConf

        values = (
            OmegaConf.to_container(node, resolve=True)
            if OmegaConf.is_config(node)
            else dict(node or {})
        )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(
                unknown_key(
                    f"train.{unknown[0]}",
                    sorted(known),
                    scope="train's",
                    every=[f"train.{k}" for k in sorted(known)],
                )
            )
        for f in fields(cls):
            if f.name in values:
                _check_type(f"train.{f.name}", values[f.name], f.type)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)

    def precision_on(self, device_type: str) -> str:
        """fp32 | bf16: `auto` is bf16 on a GPU, fp32 on a CPU (where bf16 matmuls crawl)."""
        if self.precision == "auto":
            return "bf16" if device_type == "cuda" else "fp32"
        return self.precision

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    def dims(self, world_size: int):
        """The rank layout (dtrain.parallel.mesh.ParallelDims); raises UserError when it cannot
        be."""
        from dtrain.parallel.mesh import ParallelDims

        return ParallelDims.of(
            world_size,
            tp=self.tp,
            pp=self.pp,
            strategy=self.strategy,
            hsdp_replicate=self.hsdp_replicate,
            cp=self.cp,
            ep=self.ep,
        )

    def validate(self, world_size: int) -> None:
        """Check against the world size (changes nothing: see `resolved`)."""
        from dtrain.core import checks

        checks.check_train_values(self)  # finite, AdamW-sized numbers
        if self.strategy not in STRATEGIES:
            raise UserError(
                f"train.strategy={self.strategy!r} is unknown: choose one of "
                f"{', '.join(STRATEGIES)}"
            )
        if self.precision not in PRECISIONS:
            raise UserError(
                f"train.precision={self.precision!r} is unknown: choose one of "
                f"{', '.join(PRECISIONS)}"
            )
        if self.tp_impl not in TP_IMPLS:
            raise UserError(
                f"train.tp_impl={self.tp_impl!r} is unknown: choose one of {', '.join(TP_IMPLS)}"
            )
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise UserError(
                f"train.activation_checkpointing={self.activation_checkpointing!r} is unknown: "
                f"choose one of {', '.join(ACTIVATION_CHECKPOINTING)}"
            )
        if self.strategy == "single" and world_size != 1:
            raise UserError(
                f"train.strategy=single runs on one rank but world_size={world_size}: "
                "pass world_size=1 or pick ddp / zero2 / zero3 / hsdp"
            )
        from dtrain.parallel.feasibility import check_cp_layout

        check_cp_layout(self.cp, self.cp_impl, self.pp)
        for key in ("tp", "pp", "pp_virtual", "steps", "micro_batch", "grad_accum", "ep", "etp"):
            if getattr(self, key) < 1:
                raise UserError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.strategy == "hsdp" and self.hsdp_replicate < 1:
            raise UserError(f"train.hsdp_replicate={self.hsdp_replicate} must be >= 1")
        dims = self.dims(world_size)  # tp x pp divides world_size, hsdp_replicate divides dp
        if self.global_batch is not None:
            per_micro = self.micro_batch * dims.dp
            if self.global_batch < 1 or self.global_batch % per_micro:
                raise UserError(
                    f"train.global_batch={self.global_batch} is not divisible by "
                    f"train.micro_batch x data-parallel ranks = {self.micro_batch} x {dims.dp} = "
                    f"{per_micro}: change global_batch, micro_batch or world_size"
                )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise UserError(
                f"train.lr={self.lr} and train.min_lr={self.min_lr} need 0 <= min_lr <= lr, lr > 0"
            )
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise UserError(f"train.grad_clip={self.grad_clip} must be > 0 or null")
        for key in ("warmup_steps", "timing_warmup", "log_every", "checkpoint_every"):
            if getattr(self, key) < 0:
                raise UserError(f"train.{key}={getattr(self, key)} must be >= 0")
        if self.dataset != "synthetic" and not os.path.isfile(self.dataset):
            raise UserError(
                f"train.dataset={self.dataset!r} is neither 'synthetic' nor an existing file: "
                "pass train.dataset=synthetic or the path of a token (.bin) or text file"
            )
        if self.dataset == "synthetic" and self.dataset_tokens < 2:
            raise UserError(f"train.dataset_tokens={self.dataset_tokens} must be >= 2")
        from dtrain.parallel.feasibility import SCHEDULES

        if self.pp_schedule not in SCHEDULES:
            raise UserError(
                f"train.pp_schedule={self.pp_schedule!r} is unknown: choose one of "
                f"{', '.join(SCHEDULES)}"
            )

    def resolved(self, world_size: int, device_type: str | None = None) -> "TrainConfig":
        """Validated, as a run uses it: a copy with grad_accum derived from global_batch (per
        data-parallel rank) and precision `auto` decided for the device (kept when it is None:
        not known here, e.g. before a Slurm submission)."""
        self.validate(world_size)
        grad_accum = self.grad_accum
        if self.global_batch is not None:
            grad_accum = self.global_batch // (self.micro_batch * self.dims(world_size).dp)
        precision = self.precision if device_type is None else self.precision_on(device_type)
        if device_type is not None:
            from dtrain.parallel.feasibility import check_cp_device

            check_cp_device(self.cp, self.cp_impl, device_type)
        return dataclasses.replace(self, grad_accum=grad_accum, precision=precision)

    def validate_model(self, model_cfg) -> None:
        """The layout against the model (on a `resolved` config: pp needs the real grad_accum):
        heads divisible by tp, enough layers and micro-batches for pp, a sequence cp can shard."""
        from dtrain.parallel.feasibility import (
            check_cp_model,
            check_moe,
            check_pipeline,
            check_tp_model,
        )

        check_moe(
            model_cfg,
            self.ep,
            self.etp,
            self.tp,
            self.pp,
            self.strategy,
            self.activation_checkpointing,
            self.cp,
        )
        check_tp_model(
            model_cfg, self.tp, self.sequence_parallel, self.async_grad_allreduce, self.tp_impl
        )
        check_cp_model(model_cfg, self.cp, self.cp_impl, self.tp, self.sequence_parallel)
        check_pipeline(model_cfg, self.pp, self.pp_schedule, self.pp_virtual, self.grad_accum)

    def layout(self, world_size: int, device_type: str | None = None) -> Layout:
        """The run's layout (dtrain.core.layout.Layout; call it on a `resolved` config), grad_accum
        derived from global_batch: the inverse of `dtrain.costmodel.overrides.train_overrides`.
        cp_impl
        `auto` is torch on CUDA, else ring (the device given or not known)."""
        dims = self.dims(world_size)
        run = (
            self
            if self.global_batch is None
            else dataclasses.replace(
                self, grad_accum=self.global_batch // (self.micro_batch * dims.dp)
            )
        )
        impl = (
            run.cp_impl if run.cp_impl != "auto" else "torch" if device_type == "cuda" else "ring"
        )
        return Layout.from_strategy(
            run.strategy,
            dp=dims.dp,
            hsdp_replicate=run.hsdp_replicate,
            cp=run.cp,
            tp=run.tp,
            pp=run.pp,
            recompute=recompute_of(run.activation_checkpointing),
            micro_batch=run.micro_batch,
            grad_accum=run.grad_accum,
            sequence_parallel=run.sequence_parallel,
            pp_schedule=schedule_of(run.pp_schedule)
            if run.pp > 1
            else "1f1b",  # no pipeline, no schedule
            pp_virtual=run.pp_virtual if run.pp > 1 else 1,
            cp_impl=impl if run.cp > 1 else "ring",
            ep=run.ep,
            etp=run.etp,
        )

    def global_batch_for(self, world_size: int) -> int:
        return self.micro_batch * self.grad_accum * self.dims(world_size).dp
