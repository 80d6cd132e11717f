"""Distributed checkpoints (torch.distributed.checkpoint): model + optimizer + trainer state.

`get_model_state_dict` / `get_optimizer_state_dict` give the same fully-qualified names whether
the model is plain, DDP-wrapped, FSDP2-sharded, activation-checkpoint-wrapped, tensor-parallel
(DTensor parameters with global shapes) or split into pipeline stages (each stage keeps the GPT's
names; the state of all parts is merged). The optimizer state is flattened (keyed by parameter
name, not by position), and DCP re-shards on load, so a checkpoint saved by zero3 on 2 ranks
loads into ddp on 4 or a single rank, and one saved by tp2 x pp2 loads into dp4.

The step folders: `checkpoint_folders`; their checksum manifests and damage:
`checkpoint_integrity`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dtrain.core import diskfull
from dtrain.core.errors import UserError
from dtrain.train.checkpoint_folders import resolve, step_of
from dtrain.train.checkpoint_integrity import ChecksummedWriter, damage, damaged, read_metadata


def _root_error(e: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException, else `e`."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return e


def _load_failed(path: Path, e: BaseException) -> BaseException:
    """What a failed dcp.load raises: out of memory as it is; anything else means the files are not
    what was saved (a checkpoint without manifests, or damaged after the launcher checked it): the
    damage line, naming the checkpoint to resume from instead."""
    root = _root_error(e)
    if isinstance(root, (MemoryError, torch.OutOfMemoryError)):
        return e
    # the first sentence: torch's unpickling errors go on with advice that does not apply here
    first = re.split(r"(?<=\.)\s", (str(root).strip().splitlines() or [""])[0])[0]
    problem = damage(path) or f"loading it failed: {type(root).__name__}: {first}"[:300]
    return damaged(path, problem)


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


def check_compatible(path: Path, model, steps: int) -> None:
    """Refuse, before DCP loads anything, a checkpoint this run cannot continue: one already past
    train.steps, or one of another model (its parameter names and shapes are in `.metadata`).
    `model` is a module or a list of pipeline stages; a stage's names are a subset of the
    model's."""
    done = step_of(path)
    if done is not None and steps < done:
        raise UserError(
            f"train.steps={steps} is below the checkpoint's step {done} ({path}): "
            f"pass train.steps >= {done} to continue training"
        )
    stored = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in read_metadata(path).state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    wanted = {k: tuple(v.shape) for part in parts for k, v in get_model_state_dict(part).items()}
    stage = len(parts) > 1 or getattr(parts[0], "is_pipeline_stage", False)
    if (stored if not stage else {k: stored.get(k) for k in wanted}) != wanted:
        diff = (sorted(set(stored) ^ set(wanted)) if not stage else []) or sorted(
            k for k in wanted if stored.get(k) != wanted[k]
        )
        k = diff[0]
        what = f"({k}: checkpoint {stored.get(k, 'absent')}, this run {wanted.get(k, 'absent')})"
        if not re.search(
            r"\.(weight|bias)$", k
        ):  # not a GPT parameter: an FP8 recipe's scales or history
            raise UserError(
                f"cannot resume from {path}: it was saved with another recipe's state {what}: "
                "resume with the recipe (and fp8.* keys) it was trained with"
            )
        raise UserError(
            f"cannot resume from {path}: it holds another model {what}: "
            "pass the model overrides the checkpoint was trained with"
        )


def save(path: str | Path, model, optimizer, trainer_state: dict) -> Path:
    """Collective: every rank calls it and writes its own shards. `model` is a module or a list of
    pipeline-stage modules; `optimizer` an optimizer or an OptimizerParts (one per part)."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    fresh = not Path(path).exists()
    try:
        dcp.save(
            {"model": model_sd, "optim": optim_sd, "trainer": trainer_state},
            checkpoint_id=str(path),
            storage_writer=ChecksummedWriter(str(path)),
        )
    except (Exception, CheckpointException) as e:  # DCP wraps each rank's error, a BaseException
        full = diskfull.find(e, path)
        if full is None:
            raise
        # every rank has stopped writing (DCP raises on all of them after gathering): the save's own
        # partial folder (never loadable) goes, so the run's failure record fits on the disk
        if fresh and (not dist.is_initialized() or dist.get_rank() == 0):
            shutil.rmtree(path, ignore_errors=True)
        # the errno, not DCP's wrapper or torch's "unexpected pos": the launcher's disk-full line
        raise OSError(full.errno, full.strerror, full.filename or str(path)) from None
    return Path(path)


def load(path: str | Path, model, optimizer, trainer_state: dict) -> dict:
    """Load into the (already parallelized) model and optimizer; returns the saved trainer state.

    `trainer_state` is a template with the keys to restore (DCP loads in place)."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "trainer": dict(trainer_state)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # DCP wraps each rank's error, a BaseException
        raise _load_failed(Path(path), e) from None
    pairs = _pairs(model, optimizer)
    options = _FLAT if len(pairs) == 1 else _FLAT_LOOSE  # each stage takes its own keys
    for part, opt in pairs:
        set_model_state_dict(part, state["model"], options=options)
        set_optimizer_state_dict(part, opt, state["optim"], options=options)
    return state["trainer"]


def check_resume(train, checksums: bool = True) -> None:
    """train.resume_from: a complete checkpoint (every shard its .metadata names is there, whole,
    with the bytes it was saved with; `checksums=False`: sizes only) whose step leaves something to
    train."""
    if not train.resume_from:
        return
    path = resolve(train.resume_from)
    problem = damage(path, checksums)
    if problem:
        raise damaged(path, problem)
    done = step_of(path)
    if done is not None and train.steps <= done:
        raise UserError(
            f"train.steps={train.steps} leaves nothing to train after the checkpoint's step {done} "
            f"({path}): pass train.steps > {done}"
        )
