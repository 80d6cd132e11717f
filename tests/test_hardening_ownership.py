"""Issue 20, a run owns only what it created (docs/HARDENING.md, "Ownership"): a folder the user
points at survives bad input, a checkpoint dir belongs to one run and keeps its newest few, results
files are readable by others, capstones get their own folders, a double Ctrl-C leaves no temp
folder.

In process wherever the code path allows (rundir, run_app with a stubbed launcher, the Trainer on
the tiny model); one subprocess holds the headline command line (`hydra.run.dir=precious`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import py
from dtrain.core import checks
from dtrain.core.errors import UserError
from dtrain.results.metrics import write_json_atomic, write_summary
from dtrain.run import app, precheck, precheck_dirs, rundir
from test_hardening_runs import _cfg, _stub_launch, one_error_line

TINY_RUN = ["-m", "fsdp_scaling", "model.preset=tiny", "world_size=2", "train.steps=6"]


def _tree(path: Path) -> dict:
    return {
        str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


def test_cli_bad_input_into_a_users_folder_leaves_it_as_it_was(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("x\n")
    out = py(*TINY_RUN, "train.tp=3", f"hydra.run.dir={precious}", timeout=120)
    assert out.returncode == 2
    one_error_line(out.stderr, f"hydra.run.dir={precious} is not empty (it holds thesis.txt)")
    assert _tree(precious) == {"thesis.txt": b"x\n"}


def test_current_directory_and_sweep_dirs_with_files_are_refused(tmp_path, monkeypatch):
    (tmp_path / "notes.md").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"hydra.run.dir=\. is not empty \(it holds notes.md\)"):
        precheck_dirs.check_run_dirs(["hydra.run.dir=."])
    with pytest.raises(UserError, match="hydra.sweep.dir=.* is not empty"):
        precheck_dirs.check_run_dirs(["-m", f"hydra.sweep.dir={tmp_path}", "seed=1,2"])
    (tmp_path / "hydra-only" / ".hydra").mkdir(
        parents=True
    )  # Hydra's bookkeeping alone (a torchrun peer's): fine
    (tmp_path / "hydra-only" / "fsdp-scaling.log").write_text("")
    precheck_dirs.check_run_dirs(
        [f"hydra.run.dir={tmp_path / 'hydra-only'}", f"hydra.run.dir={tmp_path / 'new'}"]
    )


def test_bad_input_removes_only_what_this_process_created(tmp_path, monkeypatch, capsys):
    bad = lambda cfg: (_ for _ in ()).throw(UserError("bad input"))  # noqa: E731
    # a folder of the user's, with files: run_app used to rmtree it (Hydra had made it "exist")
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.txt").write_text("x")
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: users)
    with pytest.raises(SystemExit) as e:
        app.run_app(
            _cfg(tmp_path),
            rank_fn=None,
            validate=lambda cfg: (users / "made.txt").write_text("") or bad(cfg),
        )
    assert e.value.code == 2 and _tree(users) == {
        "thesis.txt": b"x"
    }  # ours (made.txt) gone, theirs kept
    # the default <results_dir>/<subproject>/<time>: the run dir and the parents this run made go
    fresh = tmp_path / "results" / "fsdp-scaling" / "20260101-000000"
    rundir.remember(fresh)  # what Hydra's callback does before creating it
    fresh.mkdir(parents=True)
    (fresh / ".hydra").mkdir()
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: fresh)
    with pytest.raises(SystemExit):
        app.run_app(_cfg(tmp_path), rank_fn=None, validate=bad)
    assert not (tmp_path / "results").exists() and tmp_path.exists()
    one_error_line(capsys.readouterr().err.splitlines()[-1], "bad input")


def test_hydra_callback_remembers_the_run_dir_before_hydra_makes_it(tmp_path):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="fsdp_scaling.conf", version_base="1.3"):
        hydra_cfg = compose("config", return_hydra_config=True).hydra
    assert hydra_cfg.callbacks.remember_run_dirs._target_ == "dtrain.run.rundir.RememberRunDirs"
    run, sweep = tmp_path / "a" / "run", tmp_path / "b"
    rundir.RememberRunDirs().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run)}}}))
    rundir.RememberRunDirs().on_multirun_start(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    )
    for made in (run, sweep / "0"):
        made.mkdir(parents=True)
        assert rundir.created_here(made) and rundir.created_here(made.parent)
    assert not rundir.created_here(tmp_path)


def _claim_ckpt(path, barrier, out, run):
    barrier.wait()
    try:
        rundir.claim_folder(Path(path), "train.checkpoint_dir", Path(run))
        out.put("won")
    except UserError:
        out.put("refused")


def test_a_checkpoint_dir_belongs_to_one_run(tmp_path, monkeypatch, capsys):
    ck = tmp_path / "ck"
    assert rundir.claim_folder(ck, "train.checkpoint_dir", tmp_path / "runA") is True
    assert (
        rundir.claim_folder(ck, "train.checkpoint_dir", tmp_path / "runA") is False
    )  # runA requeued: its own
    with pytest.raises(
        UserError, match=r"train.checkpoint_dir=.*/ck belongs to another run \(started .* by pid"
    ):
        rundir.claim_folder(ck, "train.checkpoint_dir", tmp_path / "runB")
    old = tmp_path / "old"  # checkpoints from before ownership files: someone else's too
    (old / "step-000010").mkdir(parents=True)
    with pytest.raises(UserError, match=r"is not empty \(it holds step-000010\)"):
        rundir.claim_folder(old, "train.checkpoint_dir", tmp_path / "runB")
    assert not (old / rundir.OWNER).exists()
    # two runs started at once on one checkpoint dir: exactly one gets it
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_claim_ckpt, args=(tmp_path / "shared", barrier, out, f"run{i}"))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert sorted(out.get(timeout=5) for _ in procs) == ["refused"] * 3 + ["won"]
    # through run_app: the second run is refused, its own run dir removed, the first run's files
    # untouched
    before = _tree(ck)
    run_dir = tmp_path / "second"
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: run_dir)
    _stub_launch(monkeypatch)
    with pytest.raises(SystemExit) as e:
        app.run_app(_cfg(tmp_path, train={"checkpoint_dir": str(ck)}), rank_fn=None)
    assert e.value.code == 2 and not run_dir.exists() and _tree(ck) == before
    one_error_line(capsys.readouterr().err, "belongs to another run")


def test_keep_checkpoints_prunes_the_runs_own_older_ones_but_not_a_pinned_one(tmp_path):
    from test_train_loop import TINY, make_ctx, train_cfg

    from dtrain.train import Callback, Trainer

    class PinFirst(Callback):  # what the NaN guard does with its rollback target
        def on_step_end(self, trainer, step, metrics):
            if step == 2:
                trainer.pinned = {trainer.last_checkpoint}

    t = Trainer(
        make_ctx(tmp_path),
        train_cfg(steps=5, checkpoint_every=1, keep_checkpoints=2),
        TINY,
        callbacks=[PinFirst()],
    )
    t.run()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-000001", "step-000004", "step-000005"]


def test_summary_and_env_are_readable_by_other_users(tmp_path):
    old = os.umask(0o022)
    try:
        write_summary(tmp_path, {"x": 1})
        write_json_atomic(tmp_path / "env.json", {"backend": "gloo"})
    finally:
        os.umask(old)
    for name in ("summary.json", "env.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
    assert not list(tmp_path.glob(".*tmp"))


def test_capstones_get_their_own_folders(tmp_path, monkeypatch):
    from dtrain.cli.capstone import results_folder

    monkeypatch.chdir(tmp_path)
    first, second = results_folder(None), results_folder(None)  # the same second: still two folders
    assert first != second and (first / rundir.OWNER).exists() and (second / rundir.OWNER).exists()
    with pytest.raises(UserError, match="--results-dir=.* belongs to another run"):
        results_folder(str(first))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("")
    with pytest.raises(UserError, match=r"--results-dir=mine is not empty \(it holds notes.md\)"):
        results_folder("mine")


def test_a_second_ctrl_c_during_clean_up_still_removes_the_launch_temp_folder(
    tmp_path, monkeypatch
):
    import torch.multiprocessing as mp

    from dtrain.run import interrupts, local_launch, local_supervisor

    side = tmp_path / "dtrain-launch-x"
    monkeypatch.setattr(local_launch.tempfile, "mkdtemp", lambda prefix: str(side.mkdir() or side))
    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: type("Ctx", (), {"processes": []})())

    def first_ctrl_c(ctx, side_dir, timeout):
        raise interrupts.Interrupted(signal.SIGINT)

    def second_ctrl_c(procs):  # arrives while the ranks are being killed
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(local_supervisor, "supervise_local", first_ctrl_c)
    monkeypatch.setattr(local_supervisor, "kill_all", second_ctrl_c)
    cfg = OmegaConf.create({"world_size": 2, "heartbeat_timeout_s": None})
    with pytest.raises(interrupts.Interrupted), interrupts.catch_interrupts():
        local_launch.launch_local(None, cfg, tmp_path, "cpu")
    assert not side.exists()


@pytest.mark.parametrize(
    "value, message",
    [
        ("", "results_dir='' is empty: pass results_dir=<a folder>"),
        ("a" * 300, "is too long (a name of 300 bytes; the filesystem allows 255 per name"),
        ("{tmp}/loop/x", "{tmp}/loop is a symlink loop"),
        ("{tmp}/file/x", "{tmp}/file is a file, not a folder"),
    ],
)
def test_results_paths_that_cannot_hold_a_run(tmp_path, value, message):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError) as e:
        checks.check_path("results_dir", value.format(tmp=tmp_path))
    assert message.format(tmp=tmp_path) in str(e.value)


def test_unwritable_and_unicode_results_dirs_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(
        UserError, match="token recognition error.*: quote a value with non-ASCII characters"
    ):
        precheck.check_overrides("dtrain.conf", "selftest", ["results_dir=résultats"], None)
    precheck.check_overrides(
        "dtrain.conf", "selftest", ["results_dir='résultats'"], None
    )  # quoted: fine

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(
        checks.tempfile, "TemporaryDirectory", read_only
    )  # root may write anywhere: simulate
    with pytest.raises(
        UserError, match=r"results_dir='ro/x' is not writable \(Permission denied in \.\)"
    ):
        checks.check_path("results_dir", "ro/x")


def test_owner_file_names_the_run(tmp_path):
    rundir.claim_folder(tmp_path / "ck", "train.checkpoint_dir", tmp_path / "run")
    owner = json.loads((tmp_path / "ck" / rundir.OWNER).read_text())
    assert owner["run_dir"] == str(tmp_path / "run") and owner["pid"] == os.getpid()
