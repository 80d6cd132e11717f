"""Checkpoint integrity: checksum manifests written with the shards, and what is wrong with a
step folder.

Each rank, once its shards are on disk and before `.metadata` exists, writes
`.checksums.rank<N>.json` (size and sha256 of each file it wrote); rank 0 adds `.checksums.json`
(the same for `.metadata`) after it. sha256: hashlib streams it at 1-2 GB/s on CPUs with SHA
instructions, and each rank hashes only its own shards. `damage(path)` checks that every shard
`.metadata` names is there, long enough (a copy cut short, a lost file) and, when the checkpoint has
manifests, holds the bytes it was saved with (a flipped bit, an overwritten block); a checkpoint
saved before manifests existed has none and is checked for presence and length only.
`latest_intact` / `previous_intact`: the checkpoint to resume from instead of a damaged one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtrain.core.errors import UserError
from dtrain.results.metrics import write_json_atomic
from dtrain.train.checkpoint_folders import is_complete, step_of

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


class ChecksummedWriter(dcp.FileSystemWriter):
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
