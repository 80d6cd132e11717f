"""Issue 11, run directories and results (docs/HARDENING.md, first table): one run per directory,
the loader and the fp8 tools on malformed runs, a full disk, strict JSON.

Checked in process where a subprocess is not needed (the claim, run_app with a stubbed launcher,
the loader); one subprocess test holds the command-line contract for a reused hydra.run.dir.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, py
from dtrain.core.errors import UserError
from dtrain.core.files import made_path
from dtrain.core.nodes import BaseConfig, defaults
from dtrain.results import loader
from dtrain.results.metrics import RunWriter, write_config, write_summary
from dtrain.run import app, precheck_dirs, rundir
from dtrain.run.rank_failure import RankFailed

BASE = defaults(BaseConfig)


def one_error_line(stderr: str, message: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    return lines[0]


def _claim(path, barrier, out):
    barrier.wait()
    try:
        rundir.claim(Path(path))
        out.put("won")
    except rundir.RunDirTaken:
        out.put("refused")


def test_claim_is_atomic_between_concurrent_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(tmp_path, barrier, out)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    outcomes = sorted(out.get(timeout=5) for _ in procs)
    assert outcomes == ["refused"] * 5 + ["won"]
    owner = json.loads((tmp_path / rundir.OWNER).read_text())
    assert {"pid", "host", "started"} <= set(owner)


def _cfg(tmp_path, **over):
    cfg = OmegaConf.merge(
        BASE, {"subproject": "t", "results_dir": str(tmp_path), "world_size": 1, **over}
    )
    OmegaConf.set_struct(cfg, False)
    return cfg


def _stub_launch(monkeypatch, result=None, exc=None):
    def launch(rank_fn, cfg, run_dir):
        if exc is not None:
            raise exc
        write_config(run_dir, cfg)
        with RunWriter(run_dir) as w:
            w.record("step", seed=cfg.seed)
        return (result or {"seed": cfg.seed}), run_dir

    monkeypatch.setattr(app, "launch", launch)


def test_second_run_into_a_used_dir_is_refused_and_leaves_it_alone(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "same"
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: run_dir)
    _stub_launch(monkeypatch)
    app.run_app(_cfg(tmp_path, seed=1), rank_fn=None)
    first = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    for bad_too in (False, True):  # a valid second run, and one whose input is also bad
        capsys.readouterr()
        validate = (lambda cfg: (_ for _ in ()).throw(UserError("bad input"))) if bad_too else None
        with pytest.raises(SystemExit) as e:
            app.run_app(_cfg(tmp_path, seed=2), rank_fn=None, validate=validate)
        assert e.value.code == 2
        err = capsys.readouterr().err
        one_error_line(err, "bad input" if bad_too else "already holds a run")
        assert {
            p.name: p.read_bytes() for p in run_dir.iterdir()
        } == first  # nothing mixed, nothing removed


@pytest.mark.slow  # the fast path keeps a shorter test of the same property
def test_cli_sequential_and_concurrent_reuse(tmp_path):
    """Real runs: the same hydra.run.dir twice in a row, and two runs started at once."""
    args = [sys.executable, "-m", "dtrain.run.selftest", "world_size=1"]
    first = py(*args[1:], f"hydra.run.dir={tmp_path / 'seq'}", "numel=8", timeout=120)
    assert first.returncode == 0, first.stderr
    second = py(*args[1:], f"hydra.run.dir={tmp_path / 'seq'}", "numel=16", timeout=120)
    assert second.returncode == 2
    one_error_line(second.stderr, "already holds a run")
    assert [r["numel"] for r in loader.read_jsonl(tmp_path / "seq" / "records.jsonl")] == [8]

    both = [
        subprocess.Popen(
            [*args, f"hydra.run.dir={tmp_path / 'conc'}", f"numel={n}"],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for n in (8, 16)
    ]
    outs = [(p.wait(120), p.stderr.read()) for p in both]
    assert sorted(code for code, _ in outs) == [0, 2], outs
    one_error_line(next(err for code, err in outs if code == 2), "already holds a run")
    records = loader.read_jsonl(tmp_path / "conc" / "records.jsonl")
    assert len(records) == 1 and (tmp_path / "conc" / "summary.json").exists()


def test_explicit_sweep_dir_with_runs_is_refused_before_hydra(tmp_path):
    (tmp_path / "0").mkdir()
    rundir.claim(tmp_path / "0")
    with pytest.raises(UserError, match="hydra.sweep.dir=.* already holds a run"):
        precheck_dirs.check_run_dirs(["-m", f"hydra.sweep.dir={tmp_path}", "seed=1,2"])
    precheck_dirs.check_run_dirs([f"hydra.run.dir={tmp_path / 'fresh'}"])  # unused: fine


def test_run_dir_through_a_folder_not_made_yet_is_the_folder_above(tmp_path, monkeypatch):
    """`mine/new/..` is `mine` once Hydra makes `new`: the user's folder, refused before Hydra
    writes anything (found by running `hydra.run.dir=<D>/mine/../mine/x/..`: the run went into
    the user's folder beside their file)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    assert made_path(f"{mine}/../mine/x/..") == mine
    assert made_path(f"{mine}/x/y/../..") == mine
    assert made_path(f"{mine}/x/./y") == mine / "x" / "y"
    (tmp_path / "link").symlink_to(mine)  # an existing symlink's `..`: its target's parent
    assert made_path(f"{tmp_path}/link/..") == tmp_path.resolve()
    monkeypatch.chdir(tmp_path)
    assert made_path("mine/new/..") == Path("mine")
    with pytest.raises(UserError, match=r"hydra.run.dir=.*/x/.. is not empty \(it holds notes"):
        precheck_dirs.check_run_dirs([f"hydra.run.dir={mine}/../mine/x/.."])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "mine"]  # nothing made
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # a folder a run claims (train.checkpoint_dir, ...) is looked at the same way: no `x` is left
    with pytest.raises(UserError, match=r"train.checkpoint_dir=.*/mine is not empty"):
        rundir.claim_folder(Path(f"{mine}/x/.."), "train.checkpoint_dir", tmp_path / "run")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_requeued_slurm_job_may_continue_its_own_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    rundir.claim(tmp_path)
    rundir.claim(tmp_path)  # the same job, requeued: its own run
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(rundir.RunDirTaken):
        rundir.claim(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(rundir.RunDirTaken):
        rundir.claim(tmp_path)


def _run(path: Path, records: str = '{"kind": "m", "v": 1}\n', summary=True) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("subproject: x\nseed: 0\n")
    (path / "env.json").write_text('{"backend": "gloo"}')
    (path / "records.jsonl").write_text(records)
    if summary:
        (path / "summary.json").write_text('{"status": "complete"}')
    return path


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        (
            "config_list",
            lambda p: (p / "config.yaml").write_text("- 1\n- 2\n"),
            "config.yaml holds a list",
        ),
        ("env_list", lambda p: (p / "env.json").write_text("[1, 2]"), "env.json holds a list"),
        (
            "record_int",
            lambda p: (p / "records.jsonl").write_text('{"kind": "m", "v": 1}\n42\n'),
            "records.jsonl line 2: int '42', not an object",
        ),
        (
            "record_torn",
            lambda p: (p / "records.jsonl").write_text(
                '{"kind": "m", "v": 1}\n{"kind": "m", "v"\n'
            ),
            "records.jsonl line 2",
        ),
        (
            "event_list",
            lambda p: (p / "events.jsonl").write_text("[]\n"),
            "events.jsonl line 1: list",
        ),
        (
            "summary_list",
            lambda p: (p / "summary.json").write_text("[]"),
            "summary.json holds a list",
        ),
    ],
)
def test_malformed_run_is_skipped_with_a_warning_naming_the_file(
    tmp_path, name, damage, reason, capsys
):
    from dtrain.cli.main import main

    _run(tmp_path / "good")
    damage(_run(tmp_path / name))
    with pytest.warns(UserWarning) as caught:
        df = loader.load([tmp_path])
    assert list(df["v"]) == [1] and set(df["run"]) == {str(tmp_path / "good")}
    text = " ".join(str(w.message) for w in caught)
    assert f"skipping corrupt run {tmp_path / name}" in text and reason in text, text
    statuses = {r.path.name: r.status for r in loader.find_runs([tmp_path])}
    assert statuses == {"good": "complete", name: "corrupt"}
    assert main(["runs", "--all", str(tmp_path)]) == 0  # lists it as corrupt instead of crashing
    assert "corrupt" in capsys.readouterr().out


def test_guide_inputs_survive_a_malformed_run(tmp_path):
    from dtrain.costmodel.calibrate import calibrate

    _run(tmp_path / "good")
    (_run(tmp_path / "bad") / "config.yaml").write_text("[1, 2]\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = calibrate([tmp_path], warn=False)
    assert [r.path.name for r in report.runs] == ["good"]


def test_disk_full_is_one_line_with_run_failed_and_no_tmp(tmp_path, monkeypatch, capsys):
    import dtrain.results.metrics as metrics

    run_dir = tmp_path / "run"
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: run_dir)
    _stub_launch(monkeypatch)
    real_dump = json.dump

    def full_disk(obj, f, **kw):  # half a file, then ENOSPC
        f.write('{"half": ')
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "summary.json"))

    monkeypatch.setattr(metrics.json, "dump", full_disk)
    with pytest.raises(SystemExit) as e:
        app.run_app(_cfg(tmp_path), rank_fn=None)
    monkeypatch.setattr(metrics.json, "dump", real_dump)
    assert e.value.code == 1
    one_error_line(capsys.readouterr().err, "error: disk full (No space left on device")
    assert not list(run_dir.glob(".*tmp")) and not (run_dir / "summary.json").exists()
    events = loader.read_jsonl(run_dir / "events.jsonl")
    assert events[-1]["kind"] == "run_failed" and events[-1]["error"].startswith("disk full")
    # the same from a rank: its traceback ends in Errno 28
    run_dir = tmp_path / "run2"
    _stub_launch(
        monkeypatch,
        exc=RankFailed(
            "rank 1 failed:\nTraceback ...\nOSError: [Errno 28] No space left on device"
        ),
    )
    with pytest.raises(SystemExit) as e:
        app.run_app(_cfg(tmp_path), rank_fn=None)
    assert e.value.code == 1
    one_error_line(capsys.readouterr().err, "disk full (OSError: [Errno 28]")


def test_summary_json_has_no_nan_literals(tmp_path):
    write_summary(
        tmp_path,
        {"step_time_s": float("nan"), "xs": [1.0, float("inf")], "t": torch.tensor(float("nan"))},
    )
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "step_time_s": None,
        "xs": [1.0, None],
        "t": None,
    }


def test_inspect_and_dashboard_name_the_corrupt_file(tmp_path):
    from fp8_train import dashboard, inspect

    run = _run(tmp_path / "r", records='{"kind": "step", "step": 1}\n42\n')
    for tool, what in ((inspect.main, "inspect"), (dashboard.main, "a dashboard")):
        with pytest.raises(UserError) as e:
            tool([str(run)])
        assert str(e.value) == (
            f"cannot use run {run} for {what}: it is corrupt "
            "(ValueError: records.jsonl line 2: int '42', not an object)"
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no run directory"):
        loader.require_complete([tmp_path / "empty"])
