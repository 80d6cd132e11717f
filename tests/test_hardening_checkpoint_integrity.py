"""Hardening, third round, area A: checkpoint integrity and real disk-full / file-too-large errors.

Checkpoints carry per-file sha256 manifests; a same-length damage (a flipped block inside a shard,
an overwritten `.metadata`) is refused in one line naming the previous good checkpoint, in the
launcher, inside the ranks, and on a requeue (which falls back to it). A real ENOSPC (a small
tmpfs) and a real EFBIG (RLIMIT_FSIZE) during a checkpoint are one `error:` line, exit 1, with a
`run_failed` event. Trainer runs are in process on the tiny model; the command-line runs are
subprocesses (a few seconds each).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from conftest import py
from dtrain.core import diskfull
from dtrain.core.errors import UserError
from dtrain.results.loader import read_jsonl
from dtrain.train import TrainConfig, Trainer, checkpoint_folders, checkpoint_integrity
from dtrain.train.checkpoint import check_resume
from test_hardening_runs import one_error_line

RUN = [
    "-m",
    "fsdp_scaling",
    "model.preset=tiny",
    "train.timing_warmup=1",
    "profile.enabled=false",
    "world_size=1",
]


def _trained(tmp_path, steps=4, every=2) -> Path:
    """A tiny run's checkpoint folder: step-000002 and step-000004 (fsdp_scaling's tiny preset)."""
    from test_train_loop import TINY, make_ctx, train_cfg

    run = tmp_path / "train"
    run.mkdir()
    Trainer(make_ctx(run), train_cfg(steps=steps, checkpoint_every=every), TINY).run()
    return run / "checkpoints"


def _storage(step: Path, fqn: str):
    """Where DCP stored `fqn` in a step folder: (shard file, offset, length)."""
    for index, info in dcp.FileSystemReader(str(step)).read_metadata().storage_data.items():
        if index.fqn == fqn:
            return step / info.relative_path, info.offset, info.length
    raise KeyError(fqn)


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    """Same length, other bytes: what truncation checks cannot see."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    assert path.stat().st_size == size


def _flip_tok_emb(step: Path) -> str:
    shard, offset, length = _storage(step, "model.tok_emb.weight")
    _overwrite(shard, offset + length // 2, b"\x7f" * 1024)  # 1 KB inside the embedding's storage
    return shard.name


def test_every_checkpoint_has_manifests_covering_every_file(tmp_path):
    ck = _trained(tmp_path)
    step = ck / "step-000004"
    saved = checkpoint_integrity.read_manifests(step)
    files = {p.name for p in step.iterdir() if not p.name.startswith(".checksums")}
    assert set(saved) == files == {".metadata", "__0_0.distcp"}
    for name, entry in saved.items():
        assert entry["size"] == (step / name).stat().st_size
        assert entry["sha256"] == checkpoint_integrity.digest(step / name)
    assert checkpoint_integrity.damage(step) is None
    check_resume(TrainConfig(steps=6, resume_from=str(ck)))  # intact: fine


def test_a_flipped_block_in_a_shard_is_refused_naming_the_previous_good_checkpoint(tmp_path):
    ck = _trained(tmp_path)
    last, previous = ck / "step-000004", ck / "step-000002"
    shard = _flip_tok_emb(last)
    want = (
        f"checkpoint {last} is damaged (shard {shard}: checksum mismatch): "
        f"pass train.resume_from={previous}"
    )
    with pytest.raises(UserError) as e:
        check_resume(TrainConfig(steps=6, resume_from=str(last)))
    assert str(e.value) == want
    # the command line: one line, exit 2, before any rank starts, no run folder left
    out = py(*RUN, "train.steps=6", f"train.resume_from={last}", f"results_dir={tmp_path / 'r'}")
    assert out.returncode == 2, out.stderr
    assert one_error_line(out.stderr, want) == f"error: {want}"
    assert not (tmp_path / "r").exists()


def test_an_overwritten_metadata_is_refused(tmp_path):
    ck = _trained(tmp_path)
    last, previous = ck / "step-000004", ck / "step-000002"
    _overwrite(last / ".metadata", 100, b"garbage!")  # still unpickles: only the digest sees it
    with pytest.raises(UserError) as e:
        check_resume(TrainConfig(steps=6, resume_from=str(ck)))
    assert str(e.value) == (
        f"checkpoint {last} is damaged (.metadata: checksum mismatch): "
        f"pass train.resume_from={previous}"
    )


def test_a_lost_or_unreadable_manifest_is_damage_but_a_checkpoint_without_any_is_allowed(tmp_path):
    ck = _trained(tmp_path)
    last = ck / "step-000004"
    (last / ".checksums.rank0.json").unlink()
    assert checkpoint_integrity.damage(last) == "shard __0_0.distcp is in no checksum manifest"
    (last / ".checksums.json").write_text("{not json")
    want = "checksum manifest .checksums.json cannot be read: JSONDecodeError"
    assert checkpoint_integrity.damage(last) == want
    (last / ".checksums.json").unlink()  # saved before manifests existed: unverified, allowed
    assert checkpoint_integrity.damage(last) is None
    check_resume(TrainConfig(steps=6, resume_from=str(last)))


def test_damage_found_only_while_the_ranks_load_is_one_line(tmp_path):
    """A checkpoint without manifests (older) whose tensor's pickled header is overwritten passes
    the launcher's size checks; DCP's error inside the rank becomes the damage line."""
    from test_train_loop import TINY, make_ctx, train_cfg

    ck = _trained(tmp_path)
    last, previous = ck / "step-000004", ck / "step-000002"
    for p in ck.glob("step-*/.checksums*.json"):
        p.unlink()
    shard, offset, _ = _storage(last, "model.tok_emb.weight")
    _overwrite(shard, offset, b"\0" * 64)
    check_resume(TrainConfig(steps=6, resume_from=str(last)))  # sizes only: nothing seen here
    run = tmp_path / "again"
    run.mkdir()
    with pytest.raises(UserError) as e:
        Trainer(make_ctx(run), train_cfg(steps=6, resume_from=str(last)), TINY).run()
    assert str(e.value).startswith(f"checkpoint {last} is damaged (loading it failed: ")
    assert str(e.value).endswith(f"): pass train.resume_from={previous}")
    assert "\n" not in str(e.value)
    # a torn .metadata (no longer a pickle) read inside the rank: the same kind of line
    _overwrite(last / ".metadata", 0, b"\0" * 16)
    torn = r"is damaged \(\.metadata cannot be read: UnpicklingError: .*\): "
    with pytest.raises(UserError, match=torn + f"pass train.resume_from={previous}$"):
        Trainer(make_ctx(run), train_cfg(steps=6, resume_from=str(last)), TINY).run()


def test_damage_found_in_the_ranks_on_the_command_line_is_one_line_exit_2(tmp_path):
    ck = _trained(tmp_path)
    last, previous = ck / "step-000004", ck / "step-000002"
    for p in ck.glob("step-*/.checksums*.json"):
        p.unlink()
    shard, offset, _ = _storage(last, "model.tok_emb.weight")
    _overwrite(shard, offset, b"\0" * 64)
    out = py(*RUN, "train.steps=6", f"train.resume_from={ck}", f"results_dir={tmp_path / 'r'}")
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr, f"error: checkpoint {last} is damaged (loading it failed: ")
    assert line.endswith(f"): pass train.resume_from={previous}") and "Traceback" not in out.stderr


@pytest.fixture
def in_slurm_job(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return monkeypatch


def test_a_requeued_attempt_passes_over_a_damaged_latest_checkpoint(tmp_path, in_slurm_job):
    from test_requeue import TINY, SignalAt, make_ctx, step_losses, train_cfg

    full_dir, run_dir = tmp_path / "full", tmp_path / "run"
    full_dir.mkdir(), run_dir.mkdir()
    Trainer(make_ctx(full_dir), train_cfg(), TINY).run()
    first = Trainer(make_ctx(run_dir), train_cfg(checkpoint_every=2), TINY, callbacks=[SignalAt(5)])
    with pytest.raises(SystemExit):
        first.run()  # checkpoints at steps 2, 4 and (on SIGTERM) 5
    ck = run_dir / "checkpoints"
    _flip_tok_emb(ck / "step-000005")
    in_slurm_job.setenv("SLURM_RESTART_COUNT", "1")
    ctx = make_ctx(run_dir)
    result = Trainer(ctx, train_cfg(checkpoint_every=2), TINY).run()
    ctx.writer.close()
    assert step_losses(run_dir) == step_losses(full_dir)  # steps 5-8 again from step 4, once each
    events = read_jsonl(run_dir / "events.jsonl")
    [bad] = [e for e in events if e["kind"] == "checkpoint_damaged"]
    assert bad == {
        "kind": "checkpoint_damaged",
        "rank": 0,
        "path": str(ck / "step-000005"),
        "problem": "shard __0_0.distcp: checksum mismatch",
        "resumed_from": str(ck / "step-000004"),
    }
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [4] and result["steps"] == 8
    # every checkpoint damaged: the line, not a silent start from scratch
    for step in ck.glob("step-*"):
        if checkpoint_folders.is_complete(step):
            _flip_tok_emb(step)
    in_slurm_job.setenv("SLURM_RESTART_COUNT", "2")
    all_bad = (
        r"checkpoint .*step-000008 is damaged \(shard __0_0.distcp: checksum mismatch\) "
        r"and no earlier checkpoint of this run is intact: remove the damaged ones"
    )
    with pytest.raises(UserError, match=all_bad):
        Trainer(make_ctx(run_dir), train_cfg(checkpoint_every=2), TINY).run()


# ---------------------------------------------------------------- full disk, file too large


def test_wrapped_disk_full_errors_are_recognised_and_others_are_not():
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("ranks", {0: (short, None)})
    assert diskfull.find(wrapped).errno in (errno.ENOSPC, errno.EFBIG)
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/x")
        except OSError:
            raise ValueError("while saving")  # noqa: B904 (chained through __context__ on purpose)
    except ValueError as e:
        assert diskfull.find(e).errno == errno.EDQUOT
    assert diskfull.find(RuntimeError("unexpected pos 1 vs 2")) is None  # not torch's writer
    assert diskfull.find(OSError(errno.EACCES, "Permission denied")) is None
    text = (
        'rank 1 failed:\nTraceback ...\n  File "/data/Errno 28/x.py"\n'
        "OSError: [Errno 27] File too large"
    )
    assert diskfull.in_text(text) == "OSError: [Errno 27] File too large"
    assert diskfull.errno_in_text(diskfull.in_text(text)) == errno.EFBIG
    other = "Traceback ...\n  File \"/data/[Errno 28]/x.py\"\nKeyError: 'a'"  # only in a path
    assert diskfull.in_text(other) is None


def _one_line_failed_run(out, results: Path, prefix: str, event: str) -> None:
    assert out.returncode == 1, out.stderr
    one_error_line(out.stderr, prefix)
    assert "Traceback" not in out.stderr
    [run] = list((results / "fsdp-scaling").iterdir())
    assert not (run / "summary.json").exists()
    for name in ("events.jsonl", "records.jsonl"):  # no torn line in either
        if (run / name).exists():
            [json.loads(line) for line in (run / name).read_text().splitlines()]
    events = read_jsonl(run / "events.jsonl")
    assert events[-1]["kind"] == "run_failed" and events[-1]["error"].startswith(event), events
    assert not [
        p for p in (run / "checkpoints").glob("step-*") if not checkpoint_folders.is_complete(p)
    ]


@contextlib.contextmanager
def _tmpfs(size: str):
    """A tmpfs of `size` mounted at a fresh folder (skips the test where mount is not allowed)."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mnt = Path("/tmp") / f"dtrain-enospc-{uuid.uuid4().hex[:8]}"  # unique: tests may run at once
    mnt.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # -l: even if busy
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


def test_a_real_full_disk_during_a_checkpoint_is_one_line(tmp_path):
    with _tmpfs("600k") as mnt:
        out = py(*RUN, "train.steps=4", "train.checkpoint_every=2", f"results_dir={mnt / 'r'}")
        full = "error: disk full (OSError: [Errno 28] No space left"
        _one_line_failed_run(out, mnt / "r", full, "disk full: OSError: [Errno 28]")


def test_a_full_disk_while_hydra_writes_its_files_is_one_line():
    """Hydra writes .hydra/ before the task runs; there too a full disk is one line, exit 1."""
    with _tmpfs("8k") as mnt:
        out = py(*RUN, f"results_dir={mnt / 'r'}")
        assert out.returncode == 1, out.stderr
        one_error_line(out.stderr, "error: disk full (No space left on device: ")
        assert "Traceback" not in out.stderr and "/.hydra/" in out.stderr


def _file_size_limit():
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (200 << 10, hard))  # 200 KiB; a shard is 2 MB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python does: a write then fails with EFBIG


@pytest.mark.slow  # the fast path has the real full disk (ENOSPC); EFBIG takes the same path
def test_a_file_size_limit_during_a_checkpoint_is_one_line(tmp_path):
    import sys

    from conftest import REPO

    args = [
        sys.executable,
        *RUN,
        "train.steps=4",
        "train.checkpoint_every=2",
        f"results_dir={tmp_path / 'r'}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    out = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
        preexec_fn=_file_size_limit,
    )
    _one_line_failed_run(
        out,
        tmp_path / "r",
        "error: file too large (OSError: [Errno 27] File too",
        "file too large: OSError: [Errno 27]",
    )
