"""Issue 13: every config node is a dataclass (the only home of defaults), one vocabulary across the
experiments, and renamed keys refused with the new name. In process (Hydra's compose) except one
real run whose config.yaml is compared with the dataclass's defaults."""

from __future__ import annotations

import json

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from conftest import REPO, py
from dtrain.core.errors import UserError
from dtrain.core.nodes import ModelConfig
from dtrain.run import precheck
from dtrain.train import TrainConfig

APPS = [  # (config module, config name, dataclass "module:Class")
    ("fsdp_scaling.conf", "config", "fsdp_scaling.conf:FsdpScalingConfig"),
    ("fp8_train.conf", "config", "fp8_train.conf:Fp8TrainConfig"),
    ("tp_attention.conf", "config", "tp_attention.conf:TpAttentionConfig"),
    ("tp_attention.conf", "parity", "tp_attention.conf:TpParityConfig"),
    ("allreduce_bench.conf", "config", "allreduce_bench.conf:AllreduceBenchConfig"),
    ("dtrain.conf", "selftest", "dtrain.conf:SelftestConfig"),
]


def _cls(path: str):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _composed(module: str, name: str, overrides=()) -> dict:
    import importlib

    importlib.import_module(module)
    with initialize_config_module(config_module=module, version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("module, name, cls", APPS)
def test_the_yaml_holds_no_defaults_the_dataclass_has_them_all(module, name, cls):
    yaml_file = (
        REPO
        / {
            "fsdp_scaling.conf": "fsdp-scaling/fsdp_scaling",
            "fp8_train.conf": "fp8-train/fp8_train",
            "tp_attention.conf": "tp-attention/tp_attention",
            "allreduce_bench.conf": "allreduce-bench/allreduce_bench",
            "dtrain.conf": "common/dtrain",
        }[module]
        / "conf"
        / f"{name}.yaml"
    )
    assert set(yaml.safe_load(yaml_file.read_text())) <= {
        "defaults",
        "hydra",
    }  # no value outside the dataclass
    expected = OmegaConf.to_container(OmegaConf.structured(_cls(cls)), resolve=True)
    assert _composed(module, name) == expected


def test_one_model_node_and_one_train_node_everywhere():
    for cls in (
        "fsdp_scaling.conf:FsdpScalingConfig",
        "fp8_train.conf:Fp8TrainConfig",
        "tp_attention.conf:TpAttentionConfig",
    ):
        types = {f.name: f.type for f in dataclasses.fields(_cls(cls))}
        assert types["model"] in (ModelConfig, "ModelConfig"), cls
    for cls in ("fsdp_scaling.conf:FsdpScalingConfig", "fp8_train.conf:Fp8TrainConfig"):
        types = {f.name: f.type for f in dataclasses.fields(_cls(cls))}
        assert types["train"] in (TrainConfig, "TrainConfig"), cls
    # every GPTConfig field can be set from the command line, under the same name
    from dtrain.model.gpt import GPTConfig

    assert {f.name for f in dataclasses.fields(ModelConfig)} == {"preset"} | {
        f.name for f in dataclasses.fields(GPTConfig)
    }


def test_inspect_thresholds_default_from_the_dataclass():
    from fp8_train import inspect
    from fp8_train.conf import InspectConfig

    assert inspect.DEFAULTS == dataclasses.asdict(InspectConfig())
    assert inspect.thresholds({}, ["top=3"])["top"] == 3


@pytest.mark.parametrize(
    "module, override, new",
    [
        ("fsdp_scaling.conf", "train.mixed_precision=bf16", "train.precision"),
        ("fp8_train.conf", "train.mixed_precision=bf16", "train.precision"),
        ("fp8_train.conf", "precision=bf16", "train.precision"),
        ("fp8_train.conf", "+model.overrides.n_layer=3", "model.<field>, e.g. model.n_layer=4"),
        ("fsdp_scaling.conf", "+model.overrides.n_layer=3", "model.<field>, e.g. model.n_layer=4"),
        ("fp8_train.conf", "debug.freq=5", "fp8_debug.freq"),
        ("fp8_train.conf", "debug.enabled=false", "fp8_debug.enabled"),
        ("tp_attention.conf", "seq=64", "model.seq_len"),
        ("tp_attention.conf", "batch=2", "train.micro_batch"),
        ("tp_attention.conf", "dtype=bfloat16", "train.precision"),
        ("tp_attention.conf", "micro_batch=2", "train.micro_batch"),
        ("tp_attention.conf", "precision=bf16", "train.precision"),
        ("tp_attention.conf", "tp=2", "train.tp"),
        ("tp_attention.conf", "sequence_parallel=true", "train.sequence_parallel"),
        ("tp_attention.conf", "fused_qkv=true", "train.fused_qkv"),
        ("tp_attention.conf", "d_model=64", "model.d_model"),
        ("tp_attention.conf", "n_head=4", "model.n_head"),
        ("tp_attention.conf", "n_kv_head=2", "model.n_kv_head"),
        ("tp_attention.conf", "mlp_ratio=2", "model.mlp_ratio"),
        ("tp_attention.conf", "norm=layernorm", "model.norm"),
        ("tp_attention.conf", "bias=true", "model.bias"),
        ("tp_attention.conf", "warmup=1", "timing_warmup"),
        ("tp_attention.conf", "profile_steps=1", "profile.steps"),
        ("allreduce_bench.conf", "warmup_iters=1", "timing_warmup"),
    ],
)
def test_an_old_key_is_refused_naming_the_new_one(module, override, new):
    old = override.split("=")[0].lstrip("+")
    with pytest.raises(UserError) as e:
        precheck.check_overrides(module, "config", [override], None)
    assert str(e.value) == f"{old} was renamed: use {new}"
    with pytest.raises(UserError, match="was renamed"):  # in a sweep too
        precheck.check_overrides(module, "config", ["-m", override + ",", "seed=0,1"], None)


def test_the_new_keys_are_accepted():
    for module, overrides in [
        ("fsdp_scaling.conf", ["train.precision=bf16", "model.vocab_size=512", "profile.steps=1"]),
        ("fp8_train.conf", ["train.precision=auto", "model.n_layer=3", "fp8_debug.freq=5"]),
        (
            "tp_attention.conf",
            [
                "model.seq_len=64",
                "train.micro_batch=2",
                "train.precision=bf16",
                "timing_warmup=1",
                "profile.steps=1",
                "model.n_kv_head=2",
                "train.tp=[1,2]",
                "train.fused_qkv=true",
            ],
        ),
        ("allreduce_bench.conf", ["timing_warmup=1", "debug.simulate_nodes=2", "dtypes=[bf16]"]),
    ]:
        precheck.check_overrides(module, "config", overrides, None)


@pytest.mark.parametrize(
    "module, override, message",
    [
        (
            "fsdp_scaling.conf",
            "model.n_laye=4",
            "unknown key model.n_laye: did you mean model.n_layer?",
        ),
        ("fsdp_scaling.conf", "train.steps=abc", "train.steps='abc' must be an integer"),
        ("fsdp_scaling.conf", "train.grad_clip=x", "train.grad_clip='x' must be a number or null"),
        ("fp8_train.conf", "guard.lr_cut_factor=big", "guard.lr_cut_factor='big' must be a number"),
        (
            "tp_attention.conf",
            "train.micro_batch=two",
            "train.micro_batch='two' must be an integer",
        ),
        (
            "allreduce_bench.conf",
            "debug.bogus=1",
            "unknown key debug.bogus: debug's keys are simulate_nodes, inject_wrong",
        ),
    ],
)
def test_mistyped_keys_are_one_line(module, override, message):
    with pytest.raises(UserError) as e:
        precheck.check_overrides(module, "config", [override], None)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_run_writes_the_dataclass_defaults_to_config_yaml(tmp_path):
    """The run's config.yaml = the dataclass's defaults + the command line, as asked (device=auto
    stays auto: the device the ranks used is in env.json)."""
    from dtrain.conf import SelftestConfig

    out = py(
        "-m",
        "dtrain.run.selftest",
        "world_size=1",
        "numel=8",
        f"results_dir={tmp_path}",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    [written] = [
        yaml.safe_load(p.read_text())
        for p in Path(tmp_path).rglob("config.yaml")
        if ".hydra" not in str(p)
    ]
    expected = OmegaConf.to_container(
        OmegaConf.structured(SelftestConfig(world_size=1, numel=8, results_dir=str(tmp_path)))
    )
    assert written == expected and written["device"] == "auto"
    [env] = [json.loads(p.read_text()) for p in Path(tmp_path).rglob("env.json")]
    assert env["device"] == "cpu"


def test_cli_old_key_is_one_line_exit_2(tmp_path):
    out = py("-m", "fp8_train", "precision=bf16", f"results_dir={tmp_path}", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: precision was renamed: use train.precision"]
    assert not list(tmp_path.rglob("config.yaml"))


def test_precision_auto_is_bf16_on_gpu_fp32_on_cpu():
    t = TrainConfig(precision="auto")
    assert (t.precision_on("cuda"), t.precision_on("cpu")) == ("bf16", "fp32")
    assert TrainConfig(precision="bf16").precision_on("cpu") == "bf16"  # an explicit choice is kept
