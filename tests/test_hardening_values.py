"""Issue 20, impossible values and failed runs (docs/HARDENING.md, "Values and outcomes"): right
types with impossible values, bad datasets and damaged checkpoints are refused before any rank
starts; a diverged run or a crash in finalize is a failed run; a local sweep runs every point; a
leftover torchrun environment does not override launcher=local; skipped runs are named; `dtrain
plan --layout` checks its fields.

In process through dtrain.run.precheck (what the command line runs before Hydra), the Trainer on the
tiny model and run_app with a stubbed launcher; one subprocess holds the local-sweep command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import py
from dtrain.core import checks
from dtrain.core.errors import UserError
from dtrain.results import loader
from dtrain.run import app, hydra_argv, precheck, precheck_job
from dtrain.run import dist as ddist
from dtrain.train import TrainConfig
from dtrain.train.checkpoint import check_resume
from test_hardening_runs import _cfg, _stub_launch, one_error_line

FIXTURES = Path(__file__).parent / "fixtures" / "results" / "cpu"


def _check(*overrides: str) -> None:
    """What `python -m fsdp_scaling <overrides>` checks before Hydra starts (no rank, no run
    dir)."""
    from fsdp_scaling.checks import validate

    def point(cfg):
        app.check_base(cfg)
        validate(cfg)

    precheck.check_overrides(
        "fsdp_scaling.conf",
        "config",
        ["model.preset=tiny", "world_size=1", "train.strategy=single", *overrides],
        point,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=inf", "train.lr=inf must be a finite number > 0"),
        ("train.grad_clip=nan", "train.grad_clip=nan must be a finite number > 0 or null"),
        ("train.min_lr=-1", "train.min_lr=-1.0 must be a finite number >= 0"),
        ("train.beta1=1.5", "train.beta1=1.5 must be a finite number in [0, 1)"),
        ("train.beta2=nan", "train.beta2=nan must be a finite number in [0, 1)"),
        ("train.weight_decay=-1", "train.weight_decay=-1.0 must be a finite number >= 0"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints=0 must be an integer >= 1 or null"),
        ("model.vocab_size=1", "model.vocab_size=1 must be an integer >= 2 and <= 65536"),
        ("model.vocab_size=3", "model.vocab_size=3 is too small for train.dataset=synthetic"),
        ("model.init_std=nan", "model.init_std=nan must be a finite number > 0"),
        ("dist_timeout_s=0", "dist_timeout_s=0.0 must be a finite number > 0"),
        ("seed=-1", "seed=-1 must be an integer >= 0"),
        ("threads_per_rank=-1", "threads_per_rank=-1 must be an integer >= 1 or null"),
        ("heartbeat_timeout_s=0.001", "heartbeat_timeout_s=0.001 must be a number of seconds >= 2"),
        ("results_dir=", "results_dir='' is empty"),
        ("train.dataset_tokens=10", "train.dataset_tokens=10 is less than model.seq_len + 1 = 65"),
    ],
)
def test_impossible_values_are_one_line_before_any_rank(override, message):
    with pytest.raises(UserError) as e:
        _check(override)
    assert message in str(e.value) and "\n" not in str(e.value)


def _bin(path: Path, tokens) -> str:
    np.asarray(tokens, dtype="<u2").tofile(path)
    return str(path)


def test_datasets_a_rank_could_not_read_are_refused(tmp_path, monkeypatch):
    empty, odd, five = tmp_path / "empty.bin", tmp_path / "odd.bin", tmp_path / "five.txt"
    empty.write_bytes(b"")
    odd.write_bytes(b"abc")
    five.write_bytes(b"hello")
    cases = [
        (str(empty), "is 0 bytes: a nanoGPT .bin holds 2-byte (uint16) tokens, so it is empty"),
        (
            str(odd),
            "is 3 bytes: a nanoGPT .bin holds 2-byte (uint16) tokens, so it is truncated (odd "
            "length)",
        ),
        (
            _bin(tmp_path / "short.bin", [1] * 10),
            "holds 10 tokens, fewer than model.seq_len + 1 = 65",
        ),
        (str(five), "is 5 bytes, fewer tokens than model.seq_len + 1 = 65 (read as bytes)"),
        (
            _bin(tmp_path / "wide.bin", [1, 2, 300] * 40),
            "has token id 300, beyond model.vocab_size=256",
        ),
    ]
    for dataset, message in cases:
        with pytest.raises(UserError) as e:
            _check(f"train.dataset={dataset}")
        assert str(e.value).startswith(f"train.dataset={dataset!r} {message}: "), str(e.value)
    _check(f"train.dataset={_bin(tmp_path / 'good.bin', [1, 2, 200] * 40)}")  # fits: no error

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checks, "open", unreadable, raising=False)  # root reads anything: simulate
    with pytest.raises(UserError, match=r"five.txt' cannot be read \(Permission denied\)"):
        _check(f"train.dataset={five}")


def _checkpoints(tmp_path, steps=3):
    from test_train_loop import TINY, make_ctx, train_cfg

    from dtrain.train import Trainer

    t = Trainer(make_ctx(tmp_path), train_cfg(steps=steps, checkpoint_every=1), TINY)
    t.run()
    return tmp_path / "checkpoints"


def test_resume_checks_in_the_launcher_name_the_damage_and_the_way_out(tmp_path):
    ck = _checkpoints(tmp_path)
    last, previous = ck / "step-000003", ck / "step-000002"
    with pytest.raises(
        UserError,
        match=r"train.steps=3 leaves nothing to train after the checkpoint's step 3 "
        r"\(.*step-000003\): pass train.steps > 3",
    ):
        check_resume(TrainConfig(steps=3, resume_from=str(ck)))
    check_resume(TrainConfig(steps=4, resume_from=str(ck)))  # intact and something left: fine
    shard = sorted(last.glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(UserError) as e:
        check_resume(TrainConfig(steps=4, resume_from=str(last)))
    assert str(e.value) == (
        f"checkpoint {last} is damaged (shard {shard.name} is truncated: {size // 2} of "
        f"{size} bytes): pass train.resume_from={previous}"
    )
    shard.unlink()
    with pytest.raises(UserError, match=f"shard {shard.name} is missing"):
        check_resume(TrainConfig(steps=4, resume_from=str(last)))


def test_resume_with_another_recipe_or_fewer_ranks_says_what_to_pass(tmp_path):
    from fp8_train.emulated import FP8Linear
    from test_train_loop import TINY, make_ctx, train_cfg

    from dtrain.train import Trainer
    from dtrain.train.data import TokenBatcher

    fp8 = Trainer(
        make_ctx(tmp_path),
        train_cfg(steps=1),
        TINY,
        linear_factory=lambda name, i, o, bias: FP8Linear(i, o, bias),
    )
    fp8.train_step()
    path = fp8.save_checkpoint()
    plain = Trainer(make_ctx(tmp_path), train_cfg(steps=2, resume_from=path), TINY)
    with pytest.raises(
        UserError, match="it was saved with another recipe's state .*: resume with the recipe"
    ):
        plain.run()
    batcher = TokenBatcher(np.arange(1000) % 7, 8, micro_batch=2, world_size=1)
    with pytest.raises(
        ValueError,
        match="global_batch=4 but this batcher has global_batch=2; resuming would "
        "change the data: pass train.global_batch=4",
    ):
        batcher.load_state_dict({"step": 1, "micro_step": 0, "seed": 0, "global_batch": 4})


def test_a_diverged_run_fails_and_publishes_nothing(tmp_path):
    from test_train_loop import TINY, make_ctx, train_cfg

    from dtrain.train import Trainer
    from dtrain.train.train_metrics import NonFiniteLoss

    t = Trainer(make_ctx(tmp_path), train_cfg(steps=3, lr=1e30, min_lr=0.0, grad_clip=None), TINY)
    with pytest.raises(
        NonFiniteLoss, match=r"the loss is non-finite at the last step \(3\): the run diverged"
    ):
        t.run()
    steps = [r for r in loader.read_jsonl(tmp_path / "records.jsonl") if r["kind"] == "step"]
    assert (
        steps[0]["loss"] is not None
        and steps[-1]["loss"] is None
        and not (tmp_path / "summary.json").exists()
    )


def test_a_crash_in_finalize_is_a_failed_run_with_run_failed(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(app, "run_dir_for", lambda cfg: run_dir)
    _stub_launch(monkeypatch)

    def finalize(run_dir, cfg, result):
        return {"step": result["step"]}  # a finalize bug: KeyError 'step'

    with pytest.raises(SystemExit) as e:
        app.run_app(_cfg(tmp_path), rank_fn=None, finalize=finalize)
    assert e.value.code == 1 and not (run_dir / "summary.json").exists()
    failed = loader.read_jsonl(run_dir / "events.jsonl")[-1]
    assert failed == {"kind": "run_failed", "rank": 0, "error": "finalize: KeyError: 'step'"}
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and err[-1].startswith(
        "error: run failed after training (finalize: KeyError: 'step'); incomplete run left"
    )


def test_runs_that_used_to_crash_in_finalize_are_refused_up_front():
    from allreduce_bench import spec
    from omegaconf import OmegaConf
    from tp_attention.config import check_bench

    from allreduce_bench.conf import AllreduceBenchConfig
    from tp_attention.conf import TpAttentionConfig

    ar = OmegaConf.structured(AllreduceBenchConfig)
    ar.world_size, ar.collectives = 1, ["sendrecv"]
    with pytest.raises(UserError, match=r"collectives=\[sendrecv\] needs world_size >= 2"):
        spec.parse(ar)
    tp = OmegaConf.structured(TpAttentionConfig)
    tp.world_size, tp.train.tp = 2, []
    with pytest.raises(UserError, match=r"train.tp=\[\] is empty: name at least one degree"):
        check_bench(tp)


def test_cli_local_sweep_runs_every_point_and_names_the_failed_one(tmp_path):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "-m",
        "world_size=1",
        "fail_rank=0,null",
        f"results_dir={tmp_path}",
        timeout=180,
    )
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: 1 of 2 sweep points failed (#0 (world_size=1 fail_rank=0 ")
        and "exit 1" in last
    )
    runs = {r.path.name: r.status for r in loader.find_runs([tmp_path])}
    assert runs == {"0": "incomplete", "1": "complete"}  # the point after the failure ran


def test_launcher_local_ignores_a_leftover_torchrun_environment(monkeypatch):
    from omegaconf import OmegaConf

    from dtrain.run.launch import mode_of

    for k, v in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert (
        mode_of(OmegaConf.create({"launcher": "local"})) == "local"
        and ddist.detect_job("local") is None
    )
    assert (
        mode_of(OmegaConf.create({"launcher": "auto"})) == "job"
    )  # auto: this process is that rank
    job = ddist.detect_job(hydra_argv.literal_override(["launcher=auto"], "launcher"))
    with pytest.raises(
        UserError,
        match="world_size=4 but this process is rank 1 of a 2-rank job .* pass "
        "launcher=local to start 4 ranks here",
    ):
        precheck_job.check_job_size(["world_size=4"], job)
    precheck_job.check_job_size(["world_size=2"], job)  # agrees with the job
    precheck_job.check_job_size(["world_size=4", "launcher=local"], ddist.detect_job("local"))


def _broken_copies(tmp_path) -> tuple[Path, Path]:
    src = FIXTURES / "allreduce-bench" / "20250301-100000-000001"
    newer, unknown = tmp_path / "newer", tmp_path / "unknown"
    for dst, change in (
        (newer, lambda g: g.update(schema_version=999)),
        (unknown, lambda g: g["records"][0].update(kind="teleport")),
    ):
        shutil.copytree(src, dst)
        summary = json.loads((dst / "summary.json").read_text())
        change(summary["guide_inputs"])
        (dst / "summary.json").write_text(json.dumps(summary))
    return newer, unknown


def test_plan_and_calibration_name_every_skipped_run(tmp_path, capsys):
    from dtrain.cli.main import main
    from dtrain.costmodel.calibrate import calibrate_naming_skips

    newer, unknown = _broken_copies(tmp_path)
    report, skipped = calibrate_naming_skips([tmp_path])
    assert report.runs == [] and len(skipped) == 2
    assert f"skipping run {newer}: summary.json guide_inputs.schema_version=999" in skipped[0]
    assert (
        f"skipping run {unknown}: summary.json guide_inputs.records[0]: unknown kind 'teleport'"
        in skipped[1]
    )
    assert (
        main(["plan", "--params", "7e9", "--gpus", "8", "--results", str(tmp_path), "--json"]) == 0
    )
    out = capsys.readouterr()
    assert [line.split(":")[0] for line in out.err.splitlines()] == ["warning", "warning"]
    assert str(newer) in out.err and str(unknown) in out.err
    assert sum("skipped: skipping run" in n for n in json.loads(out.out)["notes"]) == 2


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            "dp=3 tp=2 pp=2",
            "--layout: dp=3·tp=2·pp=2 = 12 does not divide --gpus 8: dp·cp·tp·pp must equal the "
            "GPUs",
        ),
        (
            "dp=2 cp=1 tp=2 pp=1",
            "--layout: dp=2·cp=1·tp=2·pp=1 = 4 is not --gpus 8: dp·cp·tp·pp must equal the GPUs",
        ),
        (
            "dp=2 tp=2 pp=1",
            "matches {'dp': 2, 'tp': 2, 'pp': 1}: dp·cp·tp·pp must equal the GPUs (a cp left out "
            "is searched over powers of two that leave 2·cp chunks of >= 2048 tokens)",
        ),
        ("v=3 pp=1", "--layout: v=3 interleaves pipeline stages but pp=1: drop v= or give pp >= 2"),
        ("tp=2 tp=4", "--layout: tp= is given twice: give each field once"),
    ],
)
def test_plan_layout_fields_that_cannot_make_a_layout(layout, message, capsys):
    from dtrain.cli.main import main

    assert main(["plan", "--params", "7e9", "--gpus", "8", "--layout", layout]) == 2
    one_error_line(capsys.readouterr().err, message)
