"""Distributed checkpoints (torch.distributed.checkpoint): model + optimizer + trainer state.

`get_model_state_dict` / `get_optimizer_state_dict` give the same fully-qualified names whether
the model is plain, DDP-wrapped, FSDP2-sharded, activation-checkpoint-wrapped, tensor-parallel
(DTensor parameters with global shapes) or split into pipeline stages (each stage keeps the GPT's
names; the state of all parts is merged). The optimizer state is flattened (keyed by parameter
name, not by position), and DCP re-shards on load, so a checkpoint saved by zero3 on 2 ranks
loads into ddp on 4 or a single rank, and one saved by tp2 x pp2 loads into dp4.

Layout: <checkpoint_dir>/step-000123/ (DCP files; `.metadata` is written last, so a folder
without it is an interrupted save and is ignored when looking for the latest). Each rank, once its
shards are on disk and before `.metadata` exists, writes `.checksums.rank<N>.json` (size and sha256
of each file it wrote); rank 0 adds `.checksums.json` (the same for `.metadata`) after it. sha256:
hashlib streams it at 1-2 GB/s on CPUs with SHA instructions, and each rank hashes only its own
shards. `damage(path)` checks that every shard `.metadata` names is there, long enough (a copy cut
short, a lost file) and, when the checkpoint has manifests, holds the bytes it was saved with (a
flipped bit, an overwritten block); a checkpoint saved before manifests existed has none and is
checked for presence and length only. `prune` keeps the newest `train.keep_checkpoints` of a run's
own checkpoint folder.
"""

from __future__ import annotations

import hashlib
import json
import os
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
from dtrain.results.metrics import write_json_atomic

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
    steps = sorted(
        (int(m.group(1)), p)
        for p in path.glob("step-*")
        if (m := _STEP_DIR.match(p.name)) and is_complete(p)
    )
    if not steps:
        raise UserError(
            f"train.resume_from={str(path)!r} holds no complete checkpoint (no .metadata): "
            "pass a step-N folder written by a finished save"
        )
    return steps[-1][1]


ALGORITHM = "sha256"
MANIFEST = ".checksums.json"  # rank 0's, after .metadata: the digest of .metadata
RANK_MANIFEST = ".checksums.rank{rank}.json"  # each rank's, before .metadata: its shards' digests


def digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """The file's hex digest, read in 4 MiB blocks (checkpoints are many GB)."""
    h, buf = hashlib.new(algorithm), bytearray(4 << 20)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def write_manifest(path: Path, names, manifest: str) -> None:
    """Size and digest of `names` (files in the step folder `path`) into `path/manifest`."""
    files = {
        n: {"size": os.path.getsize(path / n), ALGORITHM: digest(path / n)} for n in sorted(names)
    }
    write_json_atomic(path / manifest, {"algorithm": ALGORITHM, "files": files})


def read_manifests(path: Path) -> dict[str, dict] | str | None:
    """Every file's saved size and digest from the step folder's manifests; None when it has none
    (saved before manifests existed), a string saying what is wrong when one cannot be read."""
    found = sorted(Path(path).glob(".checksums*.json"))
    if not found:
        return None
    files: dict[str, dict] = {}
    for f in found:
        try:
            data = json.loads(f.read_text())
            hashlib.new(data["algorithm"])
            algorithm = data["algorithm"]
            files.update({n: {**e, "algorithm": algorithm} for n, e in data["files"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"checksum manifest {f.name} cannot be read: {type(e).__name__}"
    return files


class _ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's file writer, plus each rank's manifest of the shards it wrote (before `.metadata`, so a
    save cut short is still incomplete) and rank 0's digest of `.metadata` (after it)."""

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)  # synchronous: the shards are written and synced
        names = {r.storage_data.relative_path for r in done.wait()}
        rank = self.rank
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:  # a save over an older one: its .metadata digest is stale until finish()
            (Path(self.path) / MANIFEST).unlink(missing_ok=True)
        write_manifest(Path(self.path), names, RANK_MANIFEST.format(rank=rank))
        return done

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        write_manifest(Path(self.path), [".metadata"], MANIFEST)


def _checksum_problem(
    path: Path, name: str, saved: dict | None, have: int, checksums: bool
) -> str | None:
    if saved is None:
        return f"{name} is in no checksum manifest"
    if saved.get("size") != have:
        return f"{name} is {have} bytes, {saved.get('size')} when saved"
    if checksums and saved.get(saved["algorithm"]) != digest(path / name, saved["algorithm"]):
        return f"{name}: checksum mismatch"
    return None


# the launcher checks a resume twice (precheck, then run_app): read a checkpoint through once
_checked: dict[tuple, str | None] = {}


def _state(path: Path) -> tuple:
    """The step folder's files as they are now (name, size, mtime): a changed file is read again."""
    with os.scandir(path) as it:
        files = [(e.name, e.stat()) for e in it if e.is_file()]
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in files))


def damage(path: Path, checksums: bool = True) -> str | None:
    """What is wrong with a step folder whose `.metadata` exists: a manifest that cannot be read, a
    `.metadata` that cannot be read or differs from its digest, a shard it names that is missing,
    shorter than the bytes it should hold, or (with manifests; `checksums`: digests too, else sizes
    only) not the bytes that were saved. None when whole."""
    path = Path(path)
    try:
        key = (str(path.resolve()), checksums, _state(path))
    except OSError:
        return "its folder cannot be read"
    if key not in _checked:
        _checked[key] = _damage(path, checksums)
    return _checked[key]


def _damage(path: Path, checksums: bool) -> str | None:
    saved = read_manifests(path)
    if isinstance(saved, str):
        return saved
    if saved and ".metadata" in saved:
        size = os.path.getsize(path / ".metadata")
        problem = _checksum_problem(path, ".metadata", saved[".metadata"], size, checksums)
        if problem:
            return problem
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except (
        Exception
    ) as e:  # a torn pickle, an unreadable file: whatever it is, the checkpoint cannot load
        return f".metadata cannot be read: {type(e).__name__}: {e}"[:300]
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        try:
            have = os.path.getsize(path / name)
        except OSError:
            return f"shard {name} is missing"
        if have < size:
            return f"shard {name} is truncated: {have} of {size} bytes"
        problem = saved and _checksum_problem(path, name, saved.get(name), have, checksums)
        if problem:
            return f"shard {problem}"
    return None


def previous_intact(path: Path) -> Path | None:
    """The newest undamaged step folder before `path` in the same checkpoint folder."""
    done = step_of(path)
    earlier = sorted(
        (s, p)
        for p in Path(path).parent.glob("step-*")
        if (s := step_of(p)) is not None and (done is None or s < done) and is_complete(p)
    )
    return next((p for _, p in reversed(earlier) if damage(p) is None), None)


def damaged(path: Path, problem: str) -> UserError:
    """The line for a damaged checkpoint: what is wrong, the checkpoint to resume from instead."""
    previous = previous_intact(path)
    offer = (
        f"pass train.resume_from={previous}"
        if previous
        else "no earlier complete checkpoint is next to it"
    )
    return UserError(f"checkpoint {path} is damaged ({problem}): {offer}")


def read_metadata(path: Path):
    """DCP's `.metadata` of a step folder, or the one-line damage error when it cannot be read."""
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a torn or overwritten pickle
        problem = f".metadata cannot be read: {type(e).__name__}: {e}"[:300]
        raise damaged(Path(path), problem) from None


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


def latest_intact(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete, undamaged step folder of a checkpoint folder (None when there is none),
    and the newer damaged ones passed over, each with what is wrong with it."""
    steps = sorted(
        (s, p)
        for p in Path(root).glob("step-*")
        if (s := step_of(p)) is not None and is_complete(p)
    )
    skipped = []
    for _, p in reversed(steps):
        problem = damage(p)
        if problem is None:
            return p, skipped
        skipped.append((p, problem))
    return None, skipped


def prune(checkpoint_dir: str | Path, keep: int | None, pinned=()) -> list[Path]:
    """Remove all but the newest `keep` complete step folders of a run's own checkpoint folder (and
    never one in `pinned`, e.g. the NaN guard's rollback target). Returns what was removed."""
    if not keep:
        return []
    pinned = {Path(p).resolve() for p in pinned if p}
    steps = sorted(
        (s, p)
        for p in Path(checkpoint_dir).glob("step-*")
        if (s := step_of(p)) is not None and is_complete(p)
    )
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
            storage_writer=_ChecksummedWriter(str(path)),
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
