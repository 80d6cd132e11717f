"""Distributed checkpoints (torch.distributed.checkpoint): model + optimizer + trainer state.

`get_model_state_dict` / `get_optimizer_state_dict` give the same fully-qualified names whether
the model is plain, DDP-wrapped, FSDP2-sharded, activation-checkpoint-wrapped, tensor-parallel
(DTensor parameters with global shapes) or split into pipeline stages (each stage keeps the GPT's
names; the state of all parts is merged). The optimizer state is flattened (keyed by parameter
name, not by position), and DCP re-shards on load, so a checkpoint saved by zero3 on 2 ranks
loads into ddp on 4 or a single rank, and one saved by tp2 x pp2 loads into dp4.

Layout: <checkpoint_dir>/step-000123/ (DCP files; `.metadata` is written last, so a folder
without it is an interrupted save and is ignored when looking for the latest). `damage(path)` checks
that every shard `.metadata` names is there and long enough (a copy cut short, a lost file);
`prune` keeps the newest `train.keep_checkpoints` of a run's own checkpoint folder.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dtrain.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def resolve(path: str | Path) -> Path:
    """A step folder as given, or the latest complete step-N folder inside a checkpoint folder."""
    path = Path(path)
    if is_complete(path):
        return path
    steps = sorted((int(m.group(1)), p) for p in path.glob("step-*") if (m := _STEP_DIR.match(p.name)) and is_complete(p))
    if not steps:
        raise UserError(f"train.resume_from={str(path)!r} holds no complete checkpoint (no .metadata): "
                        "pass a step-N folder written by a finished save")
    return steps[-1][1]


def damage(path: Path) -> str | None:
    """What is wrong with a step folder whose `.metadata` exists: a shard it names that is missing or
    shorter than the bytes it should hold (None when whole)."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a torn pickle, an unreadable file: whatever it is, the checkpoint cannot load
        return f".metadata cannot be read: {type(e).__name__}: {e}"[:300]
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        try:
            have = os.path.getsize(Path(path) / name)
        except OSError:
            return f"shard {name} is missing"
        if have < size:
            return f"shard {name} is truncated: {have} of {size} bytes"
    return None


def previous_intact(path: Path) -> Path | None:
    """The newest undamaged step folder before `path` in the same checkpoint folder."""
    done = step_of(path)
    earlier = sorted((s, p) for p in Path(path).parent.glob("step-*")
                     if (s := step_of(p)) is not None and (done is None or s < done) and is_complete(p))
    return next((p for _, p in reversed(earlier) if damage(p) is None), None)


def prune(checkpoint_dir: str | Path, keep: int | None, pinned=()) -> list[Path]:
    """Remove all but the newest `keep` complete step folders of a run's own checkpoint folder (and
    never one in `pinned`, e.g. the NaN guard's rollback target). Returns what was removed."""
    if not keep:
        return []
    pinned = {Path(p).resolve() for p in pinned if p}
    steps = sorted((s, p) for p in Path(checkpoint_dir).glob("step-*")
                   if (s := step_of(p)) is not None and is_complete(p))
    gone = [p for _, p in steps[:-keep] if p.resolve() not in pinned]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_FLAT_LOOSE = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def _pairs(parts, optimizer) -> list:
    """(model part, its optimizer): a trainer's parts and an AdamW or an OptimizerParts."""
    parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
    optimizers = getattr(optimizer, "optimizers", [optimizer])
    return list(zip(parts, optimizers, strict=True))


def _state_dicts(parts, optimizer) -> tuple[dict, dict]:
    model_sd, optim_sd = {}, {}
    for part, opt in _pairs(parts, optimizer):
        model_sd.update(get_model_state_dict(part, options=_FLAT))
        optim_sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
    return model_sd, optim_sd


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def check_compatible(path: Path, model, steps: int) -> None:
    """Refuse, before DCP loads anything, a checkpoint this run cannot continue: one already past
    train.steps, or one of another model (its parameter names and shapes are in `.metadata`).
    `model` is a module or a list of pipeline stages; a stage's names are a subset of the model's."""
    done = step_of(path)
    if done is not None and steps < done:
        raise UserError(f"train.steps={steps} is below the checkpoint's step {done} ({path}): "
                        f"pass train.steps >= {done} to continue training")
    stored = {k.removeprefix("model."): tuple(v.size) for k, v in
              dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
              if k.startswith("model.") and hasattr(v, "size")}
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    wanted = {k: tuple(v.shape) for part in parts for k, v in get_model_state_dict(part).items()}
    stage = len(parts) > 1 or getattr(parts[0], "is_pipeline_stage", False)
    if (stored if not stage else {k: stored.get(k) for k in wanted}) != wanted:
        diff = (sorted(set(stored) ^ set(wanted)) if not stage else []) or \
            sorted(k for k in wanted if stored.get(k) != wanted[k])
        k = diff[0]
        what = f"({k}: checkpoint {stored.get(k, 'absent')}, this run {wanted.get(k, 'absent')})"
        if not re.search(r"\.(weight|bias)$", k):  # not a GPT parameter: an FP8 recipe's scales or history
            raise UserError(f"cannot resume from {path}: it was saved with another recipe's state {what}: "
                            "resume with the recipe (and fp8.* keys) it was trained with")
        raise UserError(f"cannot resume from {path}: it holds another model {what}: "
                        "pass the model overrides the checkpoint was trained with")


def save(path: str | Path, model, optimizer, trainer_state: dict) -> Path:
    """Collective: every rank calls it and writes its own shards. `model` is a module or a list of
    pipeline-stage modules; `optimizer` an optimizer or an OptimizerParts (one per part)."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "trainer": trainer_state}, checkpoint_id=str(path))
    return Path(path)


def load(path: str | Path, model, optimizer, trainer_state: dict) -> dict:
    """Load into the (already parallelized) model and optimizer; returns the saved trainer state.

    `trainer_state` is a template with the keys to restore (DCP loads in place)."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "trainer": dict(trainer_state)}
    dcp.load(state, checkpoint_id=str(path))
    pairs = _pairs(model, optimizer)
    options = _FLAT if len(pairs) == 1 else _FLAT_LOOSE  # each stage takes its own keys
    for part, opt in pairs:
        set_model_state_dict(part, state["model"], options=options)
        set_optimizer_state_dict(part, opt, state["optim"], options=options)
    return state["trainer"]


def check_resume(train) -> None:
    """train.resume_from: a complete checkpoint (every shard its .metadata names is there, whole)
    whose step leaves something to train."""
    if not train.resume_from:
        return
    path = resolve(train.resume_from)
    problem = damage(path)
    if problem:
        previous = previous_intact(path)
        offer = f"pass train.resume_from={previous}" if previous else "no earlier complete checkpoint is next to it"
        raise UserError(f"checkpoint {path} is damaged ({problem}): {offer}")
    done = step_of(path)
    if done is not None and train.steps <= done:
        raise UserError(f"train.steps={train.steps} leaves nothing to train after the checkpoint's step {done} "
                        f"({path}): pass train.steps > {done}")
