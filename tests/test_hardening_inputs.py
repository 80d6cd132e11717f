"""Issue 11, inputs (docs/HARDENING.md, first table): overrides build one whole model, every bad
input is one `error:` line with exit 2 and no run directory, sizes that cannot fit are refused,
no false FP8 scale alert after a layer switch.

Checked in process (validate functions, precheck, the Trainer on the tiny model); a parametrized
subprocess test holds the command-line contract once per distinct code path.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import py
from dtrain.core.errors import UserError
from dtrain.core.nodes import ModelConfig
from dtrain.model.gpt import GPTConfig, num_params
from dtrain.results import loader
from dtrain.results.metrics import RunWriter
from dtrain.run import precheck, rundir
from dtrain.train import TrainConfig
from dtrain.train.memory_fit import check_fits, training_need
from test_hardening_runs import one_error_line


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

    from tp_attention.config import model_config as tp_model

    node = OmegaConf.structured(ModelConfig(preset="tiny", n_head=2))
    assert fsdp_model(node).n_kv_head == 2
    assert fp8_model(OmegaConf.create({"model": node})).n_kv_head == 2
    assert tp_model(OmegaConf.create({"model": node})) == fsdp_model(
        node
    )  # one model node everywhere
    with pytest.raises(UserError, match="model: n_head=0 must be an integer >= 1"):
        fsdp_model(OmegaConf.merge(node, {"n_head": 0}))


@pytest.mark.parametrize(
    "over, message",
    [
        ({"n_layer": 0}, "n_layer=0 must be an integer >= 1"),
        ({"n_head": 0}, "n_head=0 must be an integer >= 1"),
        ({"n_kv_head": 0}, "n_kv_head=0 must be an integer >= 1"),
        ({"d_model": "abc"}, "d_model='abc' must be an integer >= 1"),
        ({"bogus": 1}, "unknown model key 'bogus'"),
    ],
)
def test_bad_model_fields(over, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_preset("tiny", **over)


@pytest.mark.parametrize(
    "over, message",
    [
        ({"dtypes": []}, "dtypes=[] is empty"),
        ({"step_factor": 1.0000001}, "give 83177666 sizes (at most 64)"),
        ({"max_bytes": "128G"}, "max_bytes=128G is larger than 64G"),
        ({"step_factor": float("inf")}, "step_factor=inf must be a number > 1"),
    ],
)
def test_allreduce_sweep_is_bounded(over, message):
    from allreduce_bench import spec

    from allreduce_bench.conf import AllreduceBenchConfig

    cfg = OmegaConf.structured(AllreduceBenchConfig)
    cfg.world_size = 2
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    with pytest.raises(UserError) as e:
        spec.parse(cfg)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"steps": "abc"}, "train.steps='abc' must be an integer"),
        ({"lr": "fast"}, "train.lr='fast' must be a number"),
        ({"prefetch": 1}, "train.prefetch=1 must be true or false"),
        ({"grad_clip": "x"}, "train.grad_clip='x' must be a number or null"),
        (
            {"dataset": "/nonexistent"},
            "train.dataset='/nonexistent' is neither 'synthetic' nor an existing file",
        ),
    ],
)
def test_train_keys_are_typed(values, message):
    with pytest.raises(UserError) as e:
        TrainConfig.from_cfg(values).validate(1)
    assert message in str(e.value)


def test_tp_attention_and_fp8_keys():
    from fp8_train import recipes
    from tp_attention.config import check_bench

    from tp_attention.conf import TpAttentionConfig

    tp = OmegaConf.structured(TpAttentionConfig)
    tp.world_size = 2
    tp.model.n_kv_head = 0
    with pytest.raises(UserError, match=r"model: n_kv_head=0 must be an integer >= 1"):
        check_bench(tp)
    fp8 = OmegaConf.create(
        {
            "margin": 0,
            "amax_history_len": 0,
            "amax_compute_algo": "max",
            "fp16_init_scale": 1024.0,
            "e5m2_overflow": "saturate",
            "torchao_emulate": "auto",
        }
    )
    with pytest.raises(UserError, match="fp8.amax_history_len=0 must be an integer >= 1"):
        recipes.check_fp8_cfg(fp8)
    fp8.amax_history_len, fp8.amax_compute_algo = 4, "mean"
    with pytest.raises(
        UserError, match="fp8.amax_compute_algo='mean' must be one of max, most_recent"
    ):
        recipes.check_fp8_cfg(fp8)


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
    other = Trainer(
        make_ctx(tmp_path),
        train_cfg(steps=4, resume_from=path),
        GPTConfig.from_preset("tiny", n_layer=3),
    )
    with pytest.raises(
        UserError, match=r"holds another model \(blocks.2.attn.wk.weight: checkpoint absent"
    ):
        other.run()
    wider = Trainer(
        make_ctx(tmp_path),
        train_cfg(steps=4, resume_from=path),
        GPTConfig.from_preset("tiny", d_model=32),
    )
    with pytest.raises(
        UserError,
        match=r"holds another model \(blocks.0.attn.wk.weight: checkpoint \(64, 64\), "
        r"this run \(32, 32\)",
    ):
        wider.run()


def test_unknown_keys_and_bad_sweep_points_before_hydra_starts():
    with pytest.raises(
        UserError, match="unknown key foo: the top-level keys are subproject, launcher, "
    ):
        precheck.check_overrides("fsdp_scaling.conf", "config", ["foo=1"], None)
    with pytest.raises(UserError, match="no viable alternative"):
        precheck.check_overrides("fsdp_scaling.conf", "config", ["model.n_head=["], None)
    # a sweep: every point is validated, none runs when one is invalid
    from fsdp_scaling.checks import validate

    with pytest.raises(UserError) as e:
        precheck.check_overrides(
            "fsdp_scaling.conf",
            "config",
            [
                "-m",
                "model.preset=tiny",
                "model.n_head=2,0",
                "world_size=1",
                "train.strategy=single",
            ],
            validate,
        )
    lines = str(e.value).split("\nerror: ")
    assert len(lines) == 2 and lines[0].startswith(
        "sweep point #1 (model.preset=tiny model.n_head=0"
    )
    assert (
        "n_head=0 must be an integer >= 1" in lines[0]
        and lines[1] == "1 of 2 sweep points are invalid; none was run"
    )
    precheck.check_overrides(
        "fsdp_scaling.conf", "config", ["--cfg", "job", "foo=1"], None
    )  # Hydra's own flags
    # points a launcher plugin runs on Slurm are not held to this host's memory
    sweep = ["-m", "model.preset=7b,tiny"]
    with pytest.raises(UserError, match="sweep point #0 .*model.preset=7b cannot fit"):
        precheck.check_overrides("fsdp_scaling.conf", "config", sweep, validate)
    precheck.check_overrides(
        "fsdp_scaling.conf", "config", ["hydra/launcher=submitit_slurm", *sweep], validate
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--params", "nan"], "argument --params: 'nan' is not a positive parameter count"),
        (["--params", "inf"], "argument --params: 'inf' is not a positive parameter count"),
        (["--params", "7e9", "--seq", "0"], "argument --seq: 0 must be an integer > 0"),
        (
            ["--params", "7e9", "--nvlink-gbps", "nan"],
            "argument --nvlink-gbps: nan must be a finite number > 0",
        ),
        (
            ["--params", "7e9", "--ib-gbps", "inf"],
            "argument --ib-gbps: inf must be a finite number > 0",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn-hidden", "0"],
            "argument --ffn-hidden: 0 must be",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "0"],
            "argument --kv-heads: 0 must be",
        ),
        (["--params", "7e9", "--top", "-1"], "argument --top: -1 must be an integer >= 0"),
    ],
)
def test_plan_rejects_non_finite_and_non_positive_numbers(args, message, capsys):
    from dtrain.cli.main import main

    assert main(["plan", "--gpus", "8", *args]) == 2
    one_error_line(capsys.readouterr().err, message)


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("fsdp_scaling", ["train.steps=abc"], "train.steps='abc' must be an integer"),
        (
            "fsdp_scaling",
            ["model.preset=tiny", "model.n_head=0"],
            "model: n_head=0 must be an integer >= 1",
        ),
        (
            "fsdp_scaling",
            ["model.foo=1"],
            "unknown key model.foo: model's keys are preset, seq_len, n_layer",
        ),
        ("fsdp_scaling", ["model.n_head=x"], "model.n_head='x' must be an integer or null"),
        ("fsdp_scaling", ["model.preset=7b"], "model.preset=7b cannot fit: it needs about"),
        ("dtrain.run.selftest", ["-m", "world_size=1,0"], "sweep point #1 (world_size=0"),
    ],
)
def test_cli_one_line_exit_2_no_run_dir(tmp_path, module, args, message):
    out = py("-m", module, *args, f"results_dir={tmp_path}", timeout=120)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("error: ") for line in lines) and message in lines[0], (
        out.stderr
    )
    assert not list(tmp_path.rglob("config.yaml")) and not list(tmp_path.rglob(rundir.OWNER))


NO_TORCH = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as e:
    print("exit", e.code, "torch imported" if "torch" in sys.modules else "no torch")
"""


@pytest.mark.parametrize("module", ["allreduce_bench", "fsdp_scaling", "fp8_train", "tp_attention"])
def test_a_wrong_key_is_refused_before_torch_is_imported(tmp_path, module):
    """The command-line check needs the typed config, not torch or the rank code (named as
    'module:attr' and imported when the run starts): a wrong key is one line and exit 2 without
    importing torch."""
    out = py("-c", NO_TORCH, module, "no_such_key=1", f"results_dir={tmp_path}", timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "exit 2 no torch", out.stdout + out.stderr
    one_error_line(out.stderr, "unknown key no_such_key")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "module, override, message",
    [
        (
            "fsdp_scaling",
            "train.tp=3",
            "world_size=2 is not divisible by train.tp x train.pp = 3 x 1",
        ),
        ("fsdp_scaling", "model.preset=nope", "model: unknown model preset 'nope'"),
        ("fp8_train", "fp8.margin=-1", "fp8.margin=-1 must be an integer >= 0"),
        ("fp8_train", "model.n_head=3", "model: d_model=64 is not divisible by n_head=3"),
        ("tp_attention", "train.tp=3", "train.tp=3 is larger than world_size=2"),
        ("allreduce_bench", "step_factor=1", "step_factor=1.0 must be a number > 1"),
    ],
)
def test_a_wrong_value_is_refused_before_torch_is_imported(tmp_path, module, override, message):
    """The values (train.*, model.*, the subproject's own keys) are checked first, without torch
    (dtrain.train.run_checks, dtrain.parallel.feasibility, dtrain.model.args,
    allreduce_bench.spec); only a local run's device, backend, memory and checkpoint checks
    import it, after the values pass."""
    out = py("-c", NO_TORCH, module, override, f"results_dir={tmp_path}", timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "exit 2 no torch", out.stdout + out.stderr
    one_error_line(out.stderr, message)
    assert not any(tmp_path.iterdir())


def test_memory_need_is_the_cost_models_and_7b_is_refused(monkeypatch):
    model = GPTConfig.from_preset("small")
    psi = num_params(model)  # one rank holds the whole model
    ddp = training_need(model, TrainConfig(micro_batch=2, strategy="ddp"), 2)
    zero3 = training_need(model, TrainConfig(micro_batch=2, strategy="zero3"), 2)
    assert ddp.states == pytest.approx(16 * psi) and zero3.states == pytest.approx(
        8 * psi
    )  # fp32 Adam: 16Ψ / N
    big = GPTConfig.from_preset("7b")
    monkeypatch.setattr("dtrain.train.memory_fit.available_host_bytes", lambda: 64 * 2**30)
    with pytest.raises(UserError) as e:
        check_fits(big, TrainConfig(micro_batch=2), 2, torch.device("cpu"), "model.preset=7b")
    msg = str(e.value)
    need = 2 * training_need(big, TrainConfig(micro_batch=2), 2).per_rank / 2**30
    assert (
        f"needs about {need:.1f} GiB of host memory for 2 rank(s) but 64.0 GiB is available" in msg
    )
    assert "pick a smaller model.preset" in msg
    monkeypatch.setattr("dtrain.train.memory_fit.available_host_bytes", lambda: 2**50)
    check_fits(big, TrainConfig(micro_batch=2), 2, torch.device("cpu"))  # fits a 1 PiB host


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
    alerts = [e for e in loader.read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "alert"]
    assert [(a["step"], a["key"]) for a in alerts] == [(3, "1.input")]


def test_interrupt_during_the_checks_is_one_line(monkeypatch, capsys):
    from dtrain.run import app

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(precheck, "check_overrides", interrupted)
    monkeypatch.setattr("sys.argv", ["selftest", "world_size=1"])
    main = app.hydra_main("dtrain.conf", rank_fn=None, config_name="selftest")
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 130
    one_error_line(capsys.readouterr().err, "interrupted before the run started; nothing written")
