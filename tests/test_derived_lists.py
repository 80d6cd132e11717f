"""Lists derived from one home, not kept by hand (issue 38, "Derived lists"): the calibration
fields, the context-parallel implementations, the parameter count and the shared `one_of` check."""

from __future__ import annotations

import json
import random
from dataclasses import fields

import pytest

from dtrain.core.checks import integer_at_least, one_of
from dtrain.core.errors import UserError
from dtrain.costmodel import calibrate as calibrate_mod
from dtrain.costmodel.calibration import Calibration, Param, calibration_inputs
from dtrain.costmodel.gpt_shape import shape_of
from dtrain.costmodel.shapes import ModelShape
from dtrain.model.flops import flops_per_token, transformer_flops_per_token
from dtrain.model.args import (
    GPTConfig,
    num_matmul_params,
    num_params,
    param_count,
    transformer_params,
)

SEED = 38


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return random.Random(SEED)


# ---------------------------------------------------------------- calibration fields


def test_every_calibration_field_has_a_label_and_a_format():
    for f in fields(Calibration):
        assert f.metadata["label"] and f.metadata["fmt"].format(0.5), f.name
    assert calibration_inputs() == tuple(f.name for f in fields(Calibration))


def test_plan_json_carries_every_calibration_field(capsys):
    from dtrain.cli.main import main

    assert main(["plan", "--params", "7e9", "--gpus", "8", "--json"]) == 0
    calib = json.loads(capsys.readouterr().out)["calibration"]
    assert set(calib) == {f.name for f in fields(Calibration)}
    assert {"cp_overlap", "pp_overhead", "async_tp_hidden"} <= set(calib)  # once omitted
    default = Calibration()
    for k, got in calib.items():
        want = getattr(default, k)
        assert got == {"value": want.value, "provenance": want.provenance}


def test_the_guide_table_shows_every_calibration_field():
    from dtrain.guide.calibration_section import PARAM_NAMES

    assert [name for name, _, _ in PARAM_NAMES] == [f.name for f in fields(Calibration)]


def test_calibrate_picks_every_field_a_candidate_measures():
    """A measured candidate of any field, async_tp_hidden included, replaces its default."""
    from types import SimpleNamespace

    class Cand:
        def __init__(self, name):
            self.name, self.source = name, SimpleNamespace(on_gpu=True, date="2026-01-01", run="r")

        def param(self):
            return Param(0.123, f"measured here: {self.name}")

    names = calibration_inputs()
    calib = calibrate_mod._calibration([Cand(n) for n in names], False)
    picked = {n: getattr(calib, n).value for n in names}
    assert picked == dict.fromkeys(names, 0.123)


# ---------------------------------------------------------------- CP implementations


def test_one_list_of_cp_implementations():
    from dtrain.core.layout import CP_IMPLS
    from dtrain.costmodel import shapes, software
    from dtrain.parallel import feasibility
    from tp_attention.conf import CpStudyTrainConfig

    assert CP_IMPLS == ("ring", "ulysses", "torch")
    assert shapes.CP_IMPLS is CP_IMPLS and feasibility.IMPLS == ("auto", *CP_IMPLS)
    assert software.SOFTWARE["dtrain"].cp_impls == CP_IMPLS
    assert feasibility.OWN_CP_IMPLS == ("ring", "ulysses") == software.SOFTWARE["any"].cp_impls
    assert CpStudyTrainConfig().cp_impl == list(feasibility.OWN_CP_IMPLS)


# ---------------------------------------------------------------- one parameter count


def _random_gpt(rng) -> GPTConfig:
    n_kv = rng.choice([1, 2, 4])
    n_head = n_kv * rng.choice([1, 2])
    layernorm = rng.random() < 0.5
    return GPTConfig(
        vocab_size=rng.choice([64, 256, 1000]),
        seq_len=rng.choice([16, 32]),
        n_layer=rng.randint(1, 3),
        n_head=n_head,
        n_kv_head=n_kv,
        d_model=8 * n_head,
        mlp_ratio=rng.choice([2, 4]),
        norm="layernorm" if layernorm else "rmsnorm",
        bias=layernorm and rng.random() < 0.5,
        tie_embeddings=rng.random() < 0.5,
    )


def test_gpt_count_is_the_built_models(rng):
    import torch

    from dtrain.model.gpt import GPT

    for _ in range(6):
        cfg = _random_gpt(rng)
        torch.manual_seed(0)
        model = GPT(cfg)
        assert num_params(cfg) == sum(p.numel() for p in model.parameters()), cfg
        # every linear layer's weight, the lm_head's included when it is the tied embedding
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert num_matmul_params(cfg) == linear, cfg


def test_former_sites_agree_with_the_one_function(rng):
    """The cost model's ModelShape, the FLOP formula and the fit's per-rank count, each against
    transformer_params and against the closed forms they used before."""
    from dtrain.train.memory_fit import params_per_rank

    for _ in range(20):
        n_kv = rng.choice([1, 2, 8])
        n_head = n_kv * rng.choice([1, 4])
        vocab = rng.choice([32000, 50257, 128256])
        s = ModelShape(
            rng.randint(1, 80),
            128 * n_head,
            n_head,
            n_kv,
            vocab,
            4096,
            rng.choice([4.0, 2.6875, 3.5]),
            rng.random() < 0.5,
            rng.random() < 0.5,
        )
        h, kv = s.d_model, s.d_model * s.n_kv_head // s.n_head
        per_layer = h * (h + 2 * kv) + h * h + (3 if s.gated_mlp else 2) * h * s.ffn_hidden + 2 * h
        one = transformer_params(
            s.n_layer,
            s.d_model,
            s.n_head,
            s.n_kv_head,
            s.ffn_hidden,
            s.vocab,
            gated_mlp=s.gated_mlp,
            tied_embeddings=s.tied_embeddings,
        )
        assert s.params_per_layer() == per_layer == one.per_layer, s
        embedding = s.vocab * h * (1 if s.tied_embeddings else 2)
        assert s.num_params() == s.n_layer * per_layer + embedding + h == one.total, s
        assert s.embedding_params() == embedding
        matmul = s.n_layer * (per_layer - 2 * h) + s.vocab * h
        attention = 12 * s.n_layer * s.n_head * (h // s.n_head) * s.seq_len
        flops = transformer_flops_per_token(
            s.n_layer, h, s.n_head, s.n_kv_head, s.ffn_hidden, s.vocab, s.seq_len, s.gated_mlp
        )
        assert flops == 6 * matmul + attention == 6 * one.matmul + attention
    for _ in range(10):
        cfg = _random_gpt(rng)
        assert params_per_rank(cfg) == num_params(cfg) == param_count(cfg).total, cfg
        attention = 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
        assert flops_per_token(cfg) == 6 * num_matmul_params(cfg) + attention
        # the cost model's view of the GPT: no biases, no learned positions, one vector per norm
        n = param_count(cfg)
        assert shape_of(cfg).params_per_layer() == n.matmul_per_layer + 2 * cfg.d_model, cfg


# ---------------------------------------------------------------- one_of, integer_at_least


def test_one_of_says_it_in_the_one_form():
    with pytest.raises(UserError) as e:
        one_of("train.cp_impl", "x", ("ring", "ulysses", "torch"))
    assert str(e.value) == "train.cp_impl='x' must be one of ring, ulysses, torch"
    one_of("train.cp_impl", "ring", ("ring", "ulysses", "torch"))
    with pytest.raises(ValueError, match=r"^dp_sync='never' must be one of overlap, flush$"):
        one_of("dp_sync", "never", ("overlap", "flush"), error=ValueError)
    # an unhashable value against a dict: refused, no TypeError
    with pytest.raises(UserError, match=r"^key=\['a'\] must be one of a, b$"):
        one_of("key", ["a"], {"a": 1, "b": 2})
    # 1 == True in Python, yet 1 is not a choice here
    with pytest.raises(UserError, match="x=1 must be one of auto, True, False"):
        one_of("x", 1, ("auto", True, False))
    one_of("x", True, ("auto", True, False))
    with pytest.raises(UserError) as e:
        one_of("k", "z" * 1000, ("a",))
    assert "... (1,002 characters) must be one of a" in str(e.value)  # the value clipped


def test_integer_at_least_error_type():
    with pytest.raises(ValueError, match="^n_layer=0 must be an integer >= 1$"):
        integer_at_least("n_layer", 0, 1, error=ValueError)
    with pytest.raises(UserError, match="^train.cp=True must be an integer >= 1$"):
        integer_at_least("train.cp", True, 1)


def test_converted_sites_say_the_one_form():
    from dtrain.costmodel.plan_layout import parse_layout
    from dtrain.parallel.feasibility import check_cp_layout
    from dtrain.run import dist

    for call, message in [
        (
            lambda: check_cp_layout(2, "flash", 1),
            "train.cp_impl='flash' must be one of auto, ring, ulysses, torch",
        ),
        (lambda: check_cp_layout(0, "ring", 1), "train.cp=0 must be an integer >= 1"),
        (lambda: dist.device_type("tpu"), "device='tpu' must be one of auto, cpu, cuda"),
        (
            lambda: parse_layout("tp=2 schedule=dualpipe"),
            "--layout: schedule='dualpipe' must be one of 1f1b, gpipe, zbv",
        ),
    ]:
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value) == message
