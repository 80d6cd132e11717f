"""Distributed checkpoints (torch.distributed.checkpoint): model + optimizer + trainer state.

`get_state_dict` / `set_state_dict` give the same fully-qualified names whether the model is
plain, DDP-wrapped, FSDP2-sharded or activation-checkpoint-wrapped, and DCP re-shards on load,
so a checkpoint saved by zero3 on 2 ranks loads into ddp on 4 or a single rank.

Layout: <checkpoint_dir>/step-000123/ (DCP files; `.metadata` is written last, so a folder
without it is an interrupted save and is ignored when looking for the latest).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

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


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def check_compatible(path: Path, model, steps: int) -> None:
    """Refuse, before DCP loads anything, a checkpoint this run cannot continue: one already past
    train.steps, or one of another model (its parameter names and shapes are in `.metadata`)."""
    done = step_of(path)
    if done is not None and steps < done:
        raise UserError(f"train.steps={steps} is below the checkpoint's step {done} ({path}): "
                        f"pass train.steps >= {done} to continue training")
    stored = {k.removeprefix("model."): tuple(v.size) for k, v in
              dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
              if k.startswith("model.") and hasattr(v, "size")}
    wanted = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    if stored != wanted:
        diff = sorted(set(stored) ^ set(wanted)) or sorted(k for k in wanted if stored[k] != wanted[k])
        k = diff[0]
        raise UserError(f"cannot resume from {path}: it holds another model ({k}: checkpoint "
                        f"{stored.get(k, 'absent')}, this run {wanted.get(k, 'absent')}): "
                        "pass the model overrides the checkpoint was trained with")


def save(path: str | Path, model, optimizer, trainer_state: dict) -> Path:
    """Collective: every rank calls it and writes its own shards."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "trainer": trainer_state}, checkpoint_id=str(path))
    return Path(path)


def load(path: str | Path, model, optimizer, trainer_state: dict) -> dict:
    """Load into the (already parallelized) model and optimizer; returns the saved trainer state.

    `trainer_state` is a template with the keys to restore (DCP loads in place)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "trainer": dict(trainer_state)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["trainer"]
