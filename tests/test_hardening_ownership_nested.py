"""Hardening, third round (area B1): a run never writes into a folder that is, or is inside,
another run's; a requeue of a finished Slurm job touches nothing; misleading path messages are one
true line.

Command-line cases are refused by dtrain.run.precheck before Hydra creates a folder (about 1 s
each); values only the composed config knows (an interpolation) are refused again in run_app, which
removes what Hydra made. Every case checks the exact line, the exit code, that no folder was made
and that the other run's files are byte-identical (hashed before and after).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, py
from dtrain.core.errors import UserError
from dtrain.run import app, requeue, rundir
from dtrain.run.slurm_launch import SlurmTask
from test_hardening_runs import _cfg, _stub_launch

TINY = [
    "-m",
    "fsdp_scaling",
    "model.preset=tiny",
    "train.steps=4",
    "train.timing_warmup=1",
    "profile.enabled=false",
    "world_size=1",
]
OUTSIDE = "a run never writes into another run's folder"


def _hashes(path: Path) -> dict:
    """Every file under `path` (hidden ones too) with its sha256, and every folder."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(path.rglob("*"))
    }


def _complete_run(path: Path) -> Path:
    """A finished run directory as run_app leaves it: claimed, with its files and summary.json."""
    path.mkdir(parents=True)
    rundir.claim(path)
    (path / "config.yaml").write_text("subproject: fsdp-scaling\nseed: 0\n")
    (path / "env.json").write_text('{"backend": "gloo"}')
    (path / "records.jsonl").write_text('{"kind": "step", "step": 1}\n')
    (path / "checkpoints" / "step-000004").mkdir(parents=True)
    (path / "summary.json").write_text('{"status": "complete"}')
    return path


def _error(out, code: int = 2) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), (
        out.returncode,
        out.stdout,
        out.stderr,
    )
    return lines[0][len("error: ") :]


# ---------------------------------------------------------------- item 1: no run inside a run


def _nested_case(case: str, b: Path, tmp_path: Path) -> tuple[list[str], dict, str]:
    """(overrides, environment, the error line without `error: `) of each way into run b."""
    own = rundir.owner_text(b / rundir.OWNER)
    tail = f"({own}): pass a {{key}} outside any run's folder; {OUTSIDE}"
    cases = {
        "run_dir": (
            [f"hydra.run.dir={b}/nested"],
            {},
            f"hydra.run.dir={b}/nested is inside run {b} {tail}",
        ),
        "results_dir": (
            [f"results_dir={b}"],
            {},
            f"results_dir={b} is the folder of run {b} {tail}",
        ),
        "checkpoint_dir": (
            [f"hydra.run.dir={tmp_path}/mine", f"train.checkpoint_dir={b}/checkpoints/mine"],
            {},
            f"train.checkpoint_dir={b}/checkpoints/mine is inside run {b} {tail}",
        ),
        "sweep_dir": (
            ["-m", f"hydra.sweep.dir={b}/sweep", "seed=1,2"],
            {},
            f"hydra.sweep.dir={b}/sweep is inside run {b} {tail}",
        ),
        # precheck cannot read an interpolation: run_app refuses it, removing what Hydra made
        "interpolated": (
            ["hydra.run.dir=${oc.env:B_RUN}/nested"],
            {"B_RUN": str(b)},
            f"run directory {b}/nested is inside run {b} {tail}",
        ),
    }
    args, env, line = cases[case]
    key = {
        "run_dir": "hydra.run.dir",
        "interpolated": "hydra.run.dir",
        "sweep_dir": "hydra.sweep.dir",
        "checkpoint_dir": "train.checkpoint_dir",
        "results_dir": "results_dir",
    }[case]
    return args, env, line.replace("{key}", key)


@pytest.mark.parametrize(
    "case", ["run_dir", "results_dir", "checkpoint_dir", "sweep_dir", "interpolated"]
)
def test_a_run_is_never_created_inside_another_runs_folder(tmp_path, case):
    b = _complete_run(tmp_path / "B")
    before = _hashes(b)
    args, env, line = _nested_case(case, b, tmp_path)
    sweep = ["-m"] if "-m" in args else []
    results = [] if case == "results_dir" else [f"results_dir={tmp_path}/results"]
    out = py(*TINY[:2], *sweep, *TINY[2:], *(a for a in args if a != "-m"), *results, env=env)
    assert _error(out) == line
    assert _hashes(b) == before  # nothing added, nothing rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["B"]  # nothing created anywhere


def test_what_may_nest_and_what_may_not(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = _complete_run(tmp_path / "run")
    # a run's own checkpoint folder inside its own run dir is its own
    rundir.check_outside_runs("train.checkpoint_dir=x", run / "ck", "train.checkpoint_dir", own=run)
    with pytest.raises(UserError, match=f"is inside run {run} "):
        rundir.check_outside_runs("train.checkpoint_dir=x", run / "ck", "train.checkpoint_dir")
    # a checkpoint folder claimed for run A: a folder inside it names run A, not the folder
    ck = tmp_path / "ck"
    rundir.claim_folder(ck, "train.checkpoint_dir", tmp_path / "A")
    with pytest.raises(
        UserError, match=f"^results_dir=r is inside {ck}, which belongs to run {tmp_path / 'A'} "
    ):
        rundir.check_outside_runs("results_dir=r", ck / "r", "results_dir")
    # a capstone's folder (claimed for no run) holds its experiments' runs by design
    cap = tmp_path / "capstone"
    rundir.claim_folder(cap, "--results-dir", None)
    rundir.check_outside_runs("results_dir=c", cap, "results_dir")
    assert rundir.owning_run(cap / "fsdp-scaling" / "t0") is None
    # through a symlink to a run's folder
    (tmp_path / "link").symlink_to(run)
    with pytest.raises(UserError, match=f"is inside run {tmp_path / 'link'} "):
        rundir.check_outside_runs(
            "hydra.run.dir=l", tmp_path / "link" / "n", "hydra.run.dir", False
        )
    # a sweep's folder has no owner: its points are siblings, not nested runs
    sweep = tmp_path / "multirun-1"
    _complete_run(sweep / "0")
    assert rundir.owning_run(sweep / "1", include_self=False) is None


@pytest.mark.slow  # a whole run, ~7 s: test_what_may_nest_and_what_may_not checks the rule
def test_a_checkpoint_dir_inside_the_runs_own_dir_still_works(tmp_path):
    run = tmp_path / "own"
    out = py(
        *TINY,
        f"hydra.run.dir={run}",
        f"train.checkpoint_dir={run}/ck",
        "train.checkpoint_every=2",
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    kept = sorted(p.name for p in (run / "ck").iterdir())
    assert kept == [rundir.OWNER, "step-000002", "step-000004"]
    assert json.loads((run / "ck" / rundir.OWNER).read_text())["run_dir"] == str(run)


# ---------------------------------------------------------------- item 3: one true line each


def test_misleading_path_messages_are_one_true_line(tmp_path):
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "fsdp-scaling").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = _hashes(tmp_path)
    run = tmp_path / "r"
    itself = (
        f"train.checkpoint_dir={run} is the run directory itself: leave it unset "
        f"(checkpoints go to {run}/checkpoints) or pass another folder"
    )
    cases = [
        ([f"hydra.run.dir={run}", f"train.checkpoint_dir={run}"], {}, itself),
        ([f"hydra.run.dir={run}", "train.checkpoint_dir=${oc.env:R}"], {"R": str(run)}, itself),
        (
            [f"hydra.run.dir={run}", f"train.checkpoint_dir={tmp_path}/afile"],
            {},
            f"train.checkpoint_dir='{tmp_path}/afile' cannot be used: {tmp_path}/afile is a file, "
            "not a folder: pass another train.checkpoint_dir",
        ),
        (
            [f"results_dir={tmp_path}/d"],
            {},
            f"results_dir={tmp_path}/d cannot hold runs: {tmp_path}/d/fsdp-scaling is a file, not "
            "a folder: move it or pass another results_dir",
        ),
        (
            [f"results_dir={tmp_path}/dangling"],
            {},
            f"results_dir='{tmp_path}/dangling' cannot be used: {tmp_path}/dangling is a dangling "
            f"symlink (to {tmp_path}/nowhere): pass another results_dir or fix the link",
        ),
        (
            ["hydra.job.chdir=true", f"results_dir={tmp_path}/rel"],
            {},
            "hydra.job.chdir=true is not supported: dtrain resolves results_dir and paths from the "
            "launch folder; drop it",
        ),
    ]
    for args, env, line in cases:
        out = py(*TINY, *args, env=env)
        assert _error(out) == line, args
        assert _hashes(tmp_path) == before, args  # nothing created, the user's files as they were


def test_a_checkpoint_dir_that_is_a_file_is_not_another_runs(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"^train.checkpoint_dir=.*/f is a file, not a folder: "):
        rundir.claim_folder(tmp_path / "f", "train.checkpoint_dir", tmp_path / "run")
    assert (tmp_path / "f").read_text() == "x"


def _live_owner(folder: Path) -> subprocess.Popen:
    """A run folder whose owner (pid, host, argv) is a live process of this host."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "dtrain-owner"])
    folder.mkdir(parents=True)
    (folder / rundir.OWNER).write_text(
        json.dumps(
            {
                "pid": proc.pid,
                "host": socket.gethostname(),
                "argv": ["-c", "dtrain-owner"],
                "slurm_job": None,
                "started": "2026-01-01T00:00:00",
            }
        )
    )
    return proc


def test_resuming_from_a_running_runs_checkpoints_names_the_run(tmp_path):
    live = tmp_path / "live"
    proc = _live_owner(live)
    try:
        (live / "checkpoints" / "step-000002").mkdir(parents=True)
        before = _hashes(live)
        out = py(
            *TINY,
            "train.steps=8",
            f"train.resume_from={live}/checkpoints",
            f"results_dir={tmp_path}/res",
        )
        assert _error(out) == (
            f"train.resume_from={live}/checkpoints: checkpoint folder belongs to run {live}, "
            f"which is still running (pid {proc.pid} on {socket.gethostname()}): wait for it to "
            "finish or pass a finished checkpoint"
        )
        assert _hashes(live) == before and not (tmp_path / "res").exists()
    finally:
        proc.kill()
        proc.wait()
    rundir.check_not_running("train.resume_from", live / "checkpoints")  # ended: not refused
    other = _live_owner(tmp_path / "reused")  # a pid now running something else is not the run
    try:
        owner = tmp_path / "reused" / rundir.OWNER
        owner.write_text(json.dumps({**json.loads(owner.read_text()), "argv": ["x", "seed=1"]}))
        rundir.check_not_running("train.resume_from", tmp_path / "reused")
    finally:
        other.kill()
        other.wait()


# ---------------------------------------------------------------- item 2: requeue of a finished job


def _slurm_env(monkeypatch, job: str, restarts: int) -> None:
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))


def test_a_requeued_finished_run_exits_0_and_touches_nothing(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: run_dir)
    _stub_launch(monkeypatch)
    _slurm_env(monkeypatch, "41", 0)
    app.run_app(_cfg(tmp_path), rank_fn=None)  # the job's first attempt completes
    before = _hashes(run_dir)
    capsys.readouterr()
    _slurm_env(monkeypatch, "41", 1)  # `scontrol requeue 41` after it finished
    monkeypatch.setattr(app, "launch", lambda *a: pytest.fail("a finished run was launched again"))
    with pytest.raises(SystemExit) as e:
        app.run_app(_cfg(tmp_path), rank_fn=None)
    assert e.value.code == 0
    line = f"requeue: run {run_dir} is already complete (summary.json); nothing to do\n"
    assert capsys.readouterr().out == line
    assert _hashes(run_dir) == before
    # a launcher=slurm task (the client owns the run dir): the same, before any heartbeat folder
    with pytest.raises(SystemExit) as e:
        SlurmTask(None, _cfg(tmp_path), str(run_dir))()
    assert e.value.code == 0 and _hashes(run_dir) == before and not (run_dir / "slurm").exists()
    # not a requeue, or another job: no early exit (the claim decides: another job is refused)
    _slurm_env(monkeypatch, "42", 1)
    requeue.exit_if_complete(run_dir)
    _slurm_env(monkeypatch, "41", 0)
    requeue.exit_if_complete(run_dir)
    (run_dir / "summary.json").unlink()  # an unfinished run requeued continues (checkpoint resume)
    _slurm_env(monkeypatch, "41", 1)
    requeue.exit_if_complete(run_dir)


@pytest.mark.slow  # ~6 s; the fast path: test_a_requeued_finished_run_exits_0_and_touches_nothing
def test_cli_requeue_of_a_finished_job_exits_0_before_hydra_writes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "RANK"}
    env.update(PYTHONUNBUFFERED="1", SLURM_JOB_ID="41")
    run = tmp_path / "run"
    cmd = [sys.executable, *TINY, f"hydra.run.dir={run}"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=180)
    assert first.returncode == 0, first.stderr
    before = _hashes(run)
    again = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**env, "SLURM_RESTART_COUNT": "1"},
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"requeue: run {run} is already complete (summary.json); nothing to do\n"
    assert _hashes(run) == before  # .hydra/, env.json, records, the log: byte-identical
