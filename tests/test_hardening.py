"""Issue 11 (inputs, run directories, results): every case of docs/HARDENING.md's first table.

Most cases are checked in process (validate functions, the loader, run_app with a stubbed
launcher); a few subprocess tests hold the command-line contract: one `error:` line, exit 2, no
run directory.
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
from dtrain import app, precheck, results, rundir
from dtrain.errors import UserError
from dtrain.fit import check_fits, shape_of, training_need
from dtrain.costmodel.memory import params_per_gpu
from dtrain.launch import RankFailed
from dtrain.metrics import RunWriter, write_config, write_summary
from dtrain.model import GPTConfig
from dtrain.train import TrainConfig

BASE = OmegaConf.load(REPO / "common/dtrain/conf/dtrain_base.yaml")
BASE.pop("hydra")  # Hydra's own node (its ${now:} resolver exists only under Hydra)


def one_error_line(stderr: str, message: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    return lines[0]


# ------------------------------------------------------------------ 1. one run directory, one run

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
    cfg = OmegaConf.merge(BASE, {"subproject": "t", "results_dir": str(tmp_path), "world_size": 1, **over})
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
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == first  # nothing mixed, nothing removed


def test_cli_sequential_and_concurrent_reuse(tmp_path):
    """Real runs: the same hydra.run.dir twice in a row, and two runs started at once."""
    args = [sys.executable, "-m", "dtrain.selftest", "world_size=1"]
    first = py(*args[1:], f"hydra.run.dir={tmp_path / 'seq'}", "numel=8", timeout=120)
    assert first.returncode == 0, first.stderr
    second = py(*args[1:], f"hydra.run.dir={tmp_path / 'seq'}", "numel=16", timeout=120)
    assert second.returncode == 2
    one_error_line(second.stderr, "already holds a run")
    assert [r["numel"] for r in results.read_jsonl(tmp_path / "seq" / "records.jsonl")] == [8]

    both = [subprocess.Popen([*args, f"hydra.run.dir={tmp_path / 'conc'}", f"numel={n}"], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (8, 16)]
    outs = [(p.wait(120), p.stderr.read()) for p in both]
    assert sorted(code for code, _ in outs) == [0, 2], outs
    one_error_line(next(err for code, err in outs if code == 2), "already holds a run")
    records = results.read_jsonl(tmp_path / "conc" / "records.jsonl")
    assert len(records) == 1 and (tmp_path / "conc" / "summary.json").exists()


def test_explicit_sweep_dir_with_runs_is_refused_before_hydra(tmp_path):
    (tmp_path / "0").mkdir()
    rundir.claim(tmp_path / "0")
    with pytest.raises(UserError, match="hydra.sweep.dir=.* already holds a run"):
        precheck.check_run_dirs(["-m", f"hydra.sweep.dir={tmp_path}", "seed=1,2"])
    precheck.check_run_dirs([f"hydra.run.dir={tmp_path / 'fresh'}"])  # unused: fine


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


# ------------------------------------------------------------------ 2. overrides make one whole model

def test_overriding_n_head_keeps_multi_head_attention():
    cfg = GPTConfig.from_preset("small", n_head=16)
    assert (cfg.n_head, cfg.n_kv_head) == (16, 16)  # not GQA with the preset's 8 k/v heads
    tiny = GPTConfig.from_preset("tiny", n_head=2)
    assert (tiny.n_head, tiny.n_kv_head, tiny.head_dim) == (2, 2, 32)
    gqa = GPTConfig.from_preset("tiny", n_head=4, n_kv_head=2)  # set on purpose: kept
    assert gqa.n_kv_head == 2
    with pytest.raises(ValueError, match="n_head=4 is not divisible by n_kv_head=3"):
        GPTConfig.from_preset("tiny", n_kv_head=3)


def test_subproject_model_overrides_build_the_whole_model():
    from fp8_train.train import model_config as fp8_model
    from fsdp_scaling.run import model_config as fsdp_model

    node = OmegaConf.create({"preset": "tiny", "seq_len": None, "n_layer": None, "d_model": None, "n_head": 2,
                             "n_kv_head": None})
    assert fsdp_model(node).n_kv_head == 2
    assert fp8_model(OmegaConf.create({"model": {"preset": "tiny", "overrides": {"n_head": 2}}})).n_kv_head == 2
    with pytest.raises(UserError, match="model: n_head=0 must be an integer >= 1"):
        fsdp_model(OmegaConf.merge(node, {"n_head": 0}))


@pytest.mark.parametrize("over, message", [
    ({"n_layer": 0}, "n_layer=0 must be an integer >= 1"),
    ({"n_head": 0}, "n_head=0 must be an integer >= 1"),
    ({"n_kv_head": 0}, "n_kv_head=0 must be an integer >= 1"),
    ({"d_model": "abc"}, "d_model='abc' must be an integer >= 1"),
    ({"bogus": 1}, "unknown model key 'bogus'"),
])
def test_bad_model_fields(over, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_preset("tiny", **over)


# ------------------------------------------------------------------ 4. the loader skips malformed files

def _run(path: Path, records: str = '{"kind": "m", "v": 1}\n', summary=True) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("subproject: x\nseed: 0\n")
    (path / "env.json").write_text('{"backend": "gloo"}')
    (path / "records.jsonl").write_text(records)
    if summary:
        (path / "summary.json").write_text('{"status": "complete"}')
    return path


@pytest.mark.parametrize("name, damage, reason", [
    ("config_list", lambda p: (p / "config.yaml").write_text("- 1\n- 2\n"), "config.yaml holds a list"),
    ("env_list", lambda p: (p / "env.json").write_text("[1, 2]"), "env.json holds a list"),
    ("record_int", lambda p: (p / "records.jsonl").write_text('{"kind": "m", "v": 1}\n42\n'),
     "records.jsonl line 2: int '42', not an object"),
    ("record_torn", lambda p: (p / "records.jsonl").write_text('{"kind": "m", "v": 1}\n{"kind": "m", "v"\n'),
     "records.jsonl line 2"),
    ("event_list", lambda p: (p / "events.jsonl").write_text("[]\n"), "events.jsonl line 1: list"),
    ("summary_list", lambda p: (p / "summary.json").write_text("[]"), "summary.json holds a list"),
])
def test_malformed_run_is_skipped_with_a_warning_naming_the_file(tmp_path, name, damage, reason, capsys):
    from dtrain.cli import main

    _run(tmp_path / "good")
    damage(_run(tmp_path / name))
    with pytest.warns(UserWarning) as caught:
        df = results.load([tmp_path])
    assert list(df["v"]) == [1] and set(df["run"]) == {str(tmp_path / "good")}
    text = " ".join(str(w.message) for w in caught)
    assert f"skipping corrupt run {tmp_path / name}" in text and reason in text, text
    statuses = {r.path.name: r.status for r in results.find_runs([tmp_path])}
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


# ------------------------------------------------------------------ 5. bad input: one line, exit 2

@pytest.mark.parametrize("over, message", [
    ({"dtypes": []}, "dtypes=[] is empty"),
    ({"step_factor": 1.0000001}, "give 83177666 sizes (at most 64)"),
    ({"max_bytes": "128G"}, "max_bytes=128G is larger than 64G"),
    ({"step_factor": float("inf")}, "step_factor=inf must be a number > 1"),
])
def test_allreduce_sweep_is_bounded(over, message):
    from allreduce_bench import spec

    cfg = OmegaConf.load(REPO / "allreduce-bench/allreduce_bench/conf/config.yaml")
    cfg.world_size = 2
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    with pytest.raises(UserError) as e:
        spec.parse(cfg)
    assert message in str(e.value)


@pytest.mark.parametrize("values, message", [
    ({"steps": "abc"}, "train.steps='abc' must be an integer"),
    ({"lr": "fast"}, "train.lr='fast' must be a number"),
    ({"prefetch": 1}, "train.prefetch=1 must be true or false"),
    ({"grad_clip": "x"}, "train.grad_clip='x' must be a number or null"),
    ({"dataset": "/nonexistent"}, "train.dataset='/nonexistent' is neither 'synthetic' nor an existing file"),
])
def test_train_keys_are_typed(values, message):
    with pytest.raises(UserError) as e:
        TrainConfig.from_cfg(values).validate(1)
    assert message in str(e.value)


def test_tp_attention_and_fp8_keys():
    from fp8_train import backends
    from tp_attention.config import check_bench

    tp = OmegaConf.load(REPO / "tp-attention/tp_attention/conf/config.yaml")
    tp.world_size = 2
    tp.n_kv_head = 0
    with pytest.raises(UserError, match=r"n_kv_head=0 must be an integer >= 1 \(or null = n_head\)"):
        check_bench(tp)
    fp8 = OmegaConf.create({"margin": 0, "amax_history_len": 0, "amax_compute_algo": "max", "fp16_init_scale": 1024.0,
                            "e5m2_overflow": "saturate", "torchao_emulate": "auto"})
    with pytest.raises(UserError, match="fp8.amax_history_len=0 must be an integer >= 1"):
        backends.check_fp8_cfg(fp8)
    fp8.amax_history_len, fp8.amax_compute_algo = 4, "mean"
    with pytest.raises(UserError, match="fp8.amax_compute_algo='mean' is not one of max, most_recent"):
        backends.check_fp8_cfg(fp8)


def test_resume_refuses_fewer_steps_and_another_model(tmp_path):
    from test_train_loop import TINY, make_ctx, train_cfg

    from dtrain.train import Trainer

    t = Trainer(make_ctx(tmp_path), train_cfg(steps=4), TINY)
    for _ in range(3):
        t.train_step()
    path = t.save_checkpoint()
    short = Trainer(make_ctx(tmp_path), train_cfg(steps=2, resume_from=path), TINY)
    with pytest.raises(UserError, match="train.steps=2 is below the checkpoint's step 3"):
        short.run()
    other = Trainer(make_ctx(tmp_path), train_cfg(steps=4, resume_from=path), GPTConfig.from_preset("tiny", n_layer=3))
    with pytest.raises(UserError, match=r"holds another model \(blocks.2.attn.wk.weight: checkpoint absent"):
        other.run()
    wider = Trainer(make_ctx(tmp_path), train_cfg(steps=4, resume_from=path), GPTConfig.from_preset("tiny", d_model=32))
    with pytest.raises(UserError, match=r"holds another model \(blocks.0.attn.wk.weight: checkpoint \(64, 64\), "
                                        r"this run \(32, 32\)"):
        wider.run()


def test_unknown_keys_and_bad_sweep_points_before_hydra_starts():
    with pytest.raises(UserError, match="Could not override 'foo'. To append to your config use \\+foo=1"):
        precheck.check_overrides("fsdp_scaling.conf", "config", ["foo=1"], None)
    with pytest.raises(UserError, match="no viable alternative"):
        precheck.check_overrides("fsdp_scaling.conf", "config", ["model.n_head=["], None)
    # a sweep: every point is validated, none runs when one is invalid
    from fsdp_scaling.run import validate

    with pytest.raises(UserError) as e:
        precheck.check_overrides("fsdp_scaling.conf", "config", ["-m", "model.preset=tiny", "model.n_head=2,0",
                                                                 "world_size=1", "train.strategy=single"], validate)
    lines = str(e.value).split("\nerror: ")
    assert len(lines) == 2 and lines[0].startswith("sweep point #1 (model.preset=tiny model.n_head=0")
    assert "n_head=0 must be an integer >= 1" in lines[0] and lines[1] == "1 of 2 sweep points are invalid; none was run"
    precheck.check_overrides("fsdp_scaling.conf", "config", ["--cfg", "job", "foo=1"], None)  # Hydra's own flags
    # points a launcher plugin runs on Slurm are not held to this host's memory
    sweep = ["-m", "model.preset=7b,tiny"]
    with pytest.raises(UserError, match="sweep point #0 .*model.preset=7b cannot fit"):
        precheck.check_overrides("fsdp_scaling.conf", "config", sweep, validate)
    precheck.check_overrides("fsdp_scaling.conf", "config", ["hydra/launcher=submitit_slurm", *sweep], validate)


def test_disk_full_is_one_line_with_run_failed_and_no_tmp(tmp_path, monkeypatch, capsys):
    import dtrain.metrics as metrics

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
    events = results.read_jsonl(run_dir / "events.jsonl")
    assert events[-1]["kind"] == "run_failed" and events[-1]["error"].startswith("disk full")
    # the same from a rank: its traceback ends in Errno 28
    run_dir = tmp_path / "run2"
    _stub_launch(monkeypatch, exc=RankFailed("rank 1 failed:\nTraceback ...\nOSError: [Errno 28] No space left on device"))
    with pytest.raises(SystemExit) as e:
        app.run_app(_cfg(tmp_path), rank_fn=None)
    assert e.value.code == 1
    one_error_line(capsys.readouterr().err, "disk full (OSError: [Errno 28]")


@pytest.mark.parametrize("args, message", [
    (["--params", "nan"], "argument --params: nan must be a finite number > 0"),
    (["--params", "inf"], "argument --params: inf must be a finite number > 0"),
    (["--params", "7e9", "--seq", "0"], "argument --seq: 0 must be an integer > 0"),
    (["--params", "7e9", "--nvlink-gbps", "nan"], "argument --nvlink-gbps: nan must be a finite number > 0"),
    (["--params", "7e9", "--ib-gbps", "inf"], "argument --ib-gbps: inf must be a finite number > 0"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn-hidden", "0"], "argument --ffn-hidden: 0 must be"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "0"], "argument --kv-heads: 0 must be"),
    (["--params", "7e9", "--top", "-1"], "argument --top: -1 must be an integer >= 0"),
])
def test_plan_rejects_non_finite_and_non_positive_numbers(args, message, capsys):
    from dtrain.cli import main

    assert main(["plan", "--gpus", "8", *args]) == 2
    one_error_line(capsys.readouterr().err, message)


@pytest.mark.parametrize("module, args, message", [
    ("fsdp_scaling", ["train.steps=abc"], "train.steps='abc' must be an integer"),
    ("fsdp_scaling", ["model.preset=tiny", "model.n_head=0"], "model: n_head=0 must be an integer >= 1"),
    ("fsdp_scaling", ["model.foo=1"], "Could not override 'model.foo'"),
    ("fsdp_scaling", ["model.preset=7b"], "model.preset=7b cannot fit: it needs about"),
    ("dtrain.selftest", ["-m", "world_size=1,0"], "sweep point #1 (world_size=0"),
])
def test_cli_one_line_exit_2_no_run_dir(tmp_path, module, args, message):
    out = py("-m", module, *args, f"results_dir={tmp_path}", timeout=120)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("error: ") for line in lines) and message in lines[0], out.stderr
    assert not list(tmp_path.rglob("config.yaml")) and not list(tmp_path.rglob(rundir.OWNER))


# ------------------------------------------------------------------ 6. sizes that cannot fit

def test_memory_need_is_the_cost_models_and_7b_is_refused(monkeypatch):
    model = GPTConfig.from_preset("small")
    psi = params_per_gpu(shape_of(model), 1, 1)
    ddp = training_need(model, TrainConfig(micro_batch=2, strategy="ddp"), 2)
    zero3 = training_need(model, TrainConfig(micro_batch=2, strategy="zero3"), 2)
    assert ddp.states == pytest.approx(16 * psi) and zero3.states == pytest.approx(8 * psi)  # ZeRO: 16Ψ / N_d
    big = GPTConfig.from_preset("7b")
    monkeypatch.setattr("dtrain.fit.available_host_bytes", lambda: 64 * 2**30)
    with pytest.raises(UserError) as e:
        check_fits(big, TrainConfig(micro_batch=2), 2, torch.device("cpu"), "model.preset=7b")
    msg = str(e.value)
    need = 2 * training_need(big, TrainConfig(micro_batch=2), 2).per_rank / 2**30
    assert f"needs about {need:.1f} GiB of host memory for 2 rank(s) but 64.0 GiB is available" in msg
    assert "pick a smaller model.preset" in msg
    monkeypatch.setattr("dtrain.fit.available_host_bytes", lambda: 2**50)
    check_fits(big, TrainConfig(micro_batch=2), 2, torch.device("cpu"))  # fits a 1 PiB host


# ------------------------------------------------------------------ 7. smaller

def test_summary_json_has_no_nan_literals(tmp_path):
    write_summary(tmp_path, {"step_time_s": float("nan"), "xs": [1.0, float("inf")], "t": torch.tensor(float("nan"))})
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {"step_time_s": None, "xs": [1.0, None],
                                                                         "t": None}


def test_no_scale_alert_after_a_layer_switches_to_high_precision(tmp_path):
    import torch.nn as nn

    from fp8_train.backends import to_high_precision
    from fp8_train.emulated import FP8Linear
    from fp8_train.health import HealthMonitor

    class Ctx:
        writer = RunWriter(tmp_path)

    class FakeTrainer:
        model = nn.Sequential(FP8Linear(16, 16), FP8Linear(16, 16))
        ctx = Ctx()

    cfg = OmegaConf.create({"every": 1, "scale_jump": 16.0, "tensorboard": False, "window": 10})
    mon, trainer = HealthMonitor(cfg, 0, tmp_path), FakeTrainer()
    mon.check_scales(trainer, 1, {})
    to_high_precision(trainer.model[0])
    trainer.model[0].input_scaler.scale.fill_(1e-6)  # a stale scale of a switched layer
    mon.check_scales(trainer, 2, {})
    trainer.model[1].input_scaler.scale.fill_(1e-6)  # a live layer's real drop still alerts
    mon.check_scales(trainer, 3, {})
    trainer.ctx.writer.close()
    alerts = [e for e in results.read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "alert"]
    assert [(a["step"], a["key"]) for a in alerts] == [(3, "1.input")]


def test_inspect_and_dashboard_name_the_corrupt_file(tmp_path):
    from fp8_train import dashboard, inspect

    run = _run(tmp_path / "r", records='{"kind": "step", "step": 1}\n42\n')
    for tool, what in ((inspect.main, "inspect"), (dashboard.main, "a dashboard")):
        with pytest.raises(UserError) as e:
            tool([str(run)])
        assert str(e.value) == (f"cannot use run {run} for {what}: it is corrupt "
                                "(ValueError: records.jsonl line 2: int '42', not an object)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no run directory"):
        results.require_complete([tmp_path / "empty"])
