"""precision_map.rules from the command line (issue: hardening, third round, item 7): the README's
`rules: [{pattern, precision}]` works as an override and changes the matching layers' precision; a
bad rule is one line naming the rule and what is wrong with it."""

import json

import pytest
import torch.nn as nn
from conftest import py
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dtrain.core.errors import UserError
from dtrain.model.gpt import GPT
from dtrain.run import precheck, rundir
from fp8_train import backends
from fp8_train.checks import validate
from fp8_train.emulated import FP8Linear
from fp8_train.precision_map import PrecisionMap
from fp8_train.train import model_config

RULE = 'precision_map.rules=[{pattern: "blocks.0.*", precision: high}]'
FP8_CFG = OmegaConf.create(
    {
        "margin": 0,
        "amax_history_len": 4,
        "amax_compute_algo": "max",
        "fp16_init_scale": 1024.0,
        "e5m2_overflow": "saturate",
        "torchao_emulate": "auto",
    }
)


def _composed(*overrides: str):
    with initialize_config_module(config_module="fp8_train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_a_command_line_rule_keeps_the_matching_layers_in_high_precision():
    cfg = _composed(RULE, "precision_map.keep_lm_head=false")
    assert type(cfg.precision_map.rules[0]).__name__ == "DictConfig"  # what used to be refused
    model_cfg = model_config(cfg)
    pmap = PrecisionMap.from_cfg(cfg.precision_map, model_cfg)
    model = GPT(model_cfg, pmap.factory(backends.emulated_linear("emulated_delayed", FP8_CFG)))
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    names = GPT.linear_names(model_cfg)
    assert fp8 == {n for n in names if not n.startswith("blocks.0.")}
    assert all(
        type(model.get_submodule(n)) is nn.Linear for n in names if n.startswith("blocks.0.")
    )
    reasons = {d.name: d.reason for d in pmap.all_decisions()}
    assert (
        reasons["blocks.0.mlp.w2"] == "rule 'blocks.0.*'"
        and reasons["blocks.1.mlp.w2"] == "default"
    )


@pytest.mark.slow  # a whole run, ~6 s; the rule's resolution is checked in-process above
def test_a_short_run_records_the_rules_precision(tmp_path):
    out = py(
        "-m",
        "fp8_train",
        RULE,
        "train.steps=2",
        "world_size=1",
        "health.enabled=false",
        f"results_dir={tmp_path}",
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    records = [
        json.loads(line) for line in next(tmp_path.rglob("records.jsonl")).read_text().splitlines()
    ]
    precision = {
        r["layer"]: (r["precision"], r["reason"]) for r in records if r["kind"] == "layer_precision"
    }
    assert precision["blocks.0.attn.wq"] == ("high", "rule 'blocks.0.*'")
    assert precision["blocks.1.attn.wq"] == ("fp8", "default")
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert "blocks.0.mlp.w1" in summary["high_precision_layers"]
    assert "blocks.1.mlp.w1" not in summary["high_precision_layers"]


SHAPE = "{pattern: <fnmatch pattern on layer names, e.g. blocks.0.*>, precision: fp8|high}"
LAYERS = (
    "blocks.0.attn.wq, blocks.0.attn.wk, blocks.0.attn.wv, blocks.0.attn.wo, blocks.0.mlp.w1, "
    "blocks.0.mlp.w2, ..., lm_head"
)


@pytest.mark.parametrize(
    "rules, message",
    [
        (
            '[{pattern: "blocks.0.*", precision: high}, {pattern: "(", precision: fp8}]',
            "precision_map.rules[1]: pattern '(' matches no linear layer of this model "
            f"({LAYERS}): patterns are fnmatch, not regular expressions, e.g. blocks.0.* or "
            "blocks.*.mlp.w2",
        ),
        (
            '[{pattern: "blocks\\.0\\..*", precision: high}]',
            "precision_map.rules[0]: pattern 'blocks\\\\.0\\\\..*' matches no linear layer of "
            f"this model ({LAYERS}): patterns are fnmatch, not regular expressions, e.g. "
            "blocks.0.* or blocks.*.mlp.w2",
        ),
        (
            '[{pattern: "blocks.9.*", precision: high}]',
            "precision_map.rules[0]: pattern 'blocks.9.*' matches no linear layer of this model "
            f"({LAYERS}): check the layer name, e.g. blocks.0.* or blocks.*.mlp.w2",
        ),
        (
            '[{pattern: "blocks.0.*"}]',
            "precision_map.rules[0]: needs a 'precision' key (one of fp8, high; high: "
            "the run's non-FP8 precision, bf16 on GPU, fp32 on CPU)",
        ),
        (
            "[{precision: high}]",
            "precision_map.rules[0]: needs a 'pattern' key (an fnmatch pattern on layer "
            "names, e.g. blocks.0.* or lm_head)",
        ),
        (
            "[{pattern: lm_head, precision: bf16}]",
            "precision_map.rules[0]: precision='bf16' is not one of fp8, "
            "high (high: the run's non-FP8 precision, bf16 on GPU, fp32 on CPU)",
        ),
        ("[lm_head]", f"precision_map.rules[0]='lm_head' is not a rule: write {SHAPE}"),
        (
            "[{pattern: lm_head, precision: high, when: 3}]",
            "precision_map.rules[0]: unknown key 'when': a rule has only pattern and precision, "
            f"{SHAPE}",
        ),
        (
            "[{pattern: 3, precision: high}]",
            "precision_map.rules[0]: pattern=3 must be a non-empty fnmatch pattern on layer "
            "names, e.g. blocks.0.*",
        ),
    ],
)
def test_a_bad_rule_is_named_with_what_is_wrong(rules, message):
    with pytest.raises(UserError) as e:
        precheck.check_overrides(
            "fp8_train.conf", "config", [f"precision_map.rules={rules}", "world_size=1"], validate
        )
    assert str(e.value) == message


def test_a_bad_rule_on_the_command_line_is_one_line_exit_2_no_run_dir(tmp_path):
    out = py(
        "-m",
        "fp8_train",
        "precision_map.rules=[{pattern: lm_head, precision: bf16}]",
        f"results_dir={tmp_path}",
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: precision_map.rules[0]: precision='bf16' is not one of fp8, high (high: the run's "
        "non-FP8 precision, bf16 on GPU, fp32 on CPU)"
    ], out.stderr
    assert not list(tmp_path.rglob("config.yaml")) and not list(tmp_path.rglob(rundir.OWNER))
