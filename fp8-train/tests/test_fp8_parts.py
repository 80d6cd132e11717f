"""Precision map, backends (TransformerEngine glue through a stand-in module), the recovery
ladder's rollback, inspect's ranking and compare's within-noise arithmetic."""

import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from dtrain.core.errors import UserError
from dtrain.model.gpt import GPT, GPTConfig
from dtrain.results.metrics import RunWriter
from dtrain.run.dist import DistEnv
from dtrain.run.rank import RankContext
from dtrain.train import TrainConfig, Trainer
from fp8_train import backends, compare, faults, inspect, te_backend
from fp8_train.conf import GuardConfig
from fp8_train.emulated import FP8Linear
from fp8_train.guard import NanGuard
from fp8_train.precision_map import PrecisionMap

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


def test_precision_map_applies_to_the_right_modules():
    cfg = GPTConfig.from_preset("tiny", n_layer=3)
    pmap = PrecisionMap.from_cfg(
        {
            "keep_first_block": True,
            "keep_lm_head": True,
            "rules": [{"pattern": "blocks.*.mlp.w2", "precision": "high"}],
        },
        cfg,
    )
    model = GPT(cfg, pmap.factory(backends.emulated_linear("emulated_delayed", FP8_CFG)))
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert fp8 == {
        f"blocks.{i}.{n}"
        for i in (1, 2)
        for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1")
    }
    assert type(model.lm_head) is nn.Linear and type(model.blocks[0].attn.wq) is nn.Linear
    assert {"tok_emb", "pos_emb", "lm_head", "blocks.0.mlp.w1", "blocks.2.mlp.w2"} <= set(
        pmap.high_precision_layers()
    )


def test_dims_not_multiple_of_16_fall_back_with_a_reason():
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=40)
    pmap = PrecisionMap([], "fp8")
    GPT(cfg, pmap.factory(backends.emulated_linear("emulated_current", FP8_CFG)))
    assert {d.name for d in pmap.fallbacks()} == set(
        GPT.linear_names(cfg)
    )  # 40 is not a multiple of 16
    assert "not both multiples of 16" in pmap.fallbacks()[0].reason
    with pytest.raises(UserError, match="precision='fp4'"):
        PrecisionMap([("lm_head", "fp4")])


def test_te_selected_without_cuda_is_one_clear_error():
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        backends.check("te_delayed", "cpu")
    with pytest.raises(UserError, match="recipe='bogus' must be one of "):
        backends.check("bogus", "cpu")


def _fake_te(monkeypatch):
    """A stand-in transformer_engine package: records what our glue asks of it."""
    calls = []

    class Recipe:
        def __init__(self, **kw):
            self.kw = kw

    recipe_mod = types.SimpleNamespace(
        Format=types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3"),
        DelayedScaling=type("DelayedScaling", (Recipe,), {}),
        Float8CurrentScaling=type("Float8CurrentScaling", (Recipe,), {}),
        Float8BlockScaling=type("Float8BlockScaling", (Recipe,), {}),
        MXFP8BlockScaling=type("MXFP8BlockScaling", (Recipe,), {}),
    )

    class Linear(nn.Linear):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            calls.append(("Linear", i, o, bias, params_dtype, str(device)))
            super().__init__(i, o, bias=bias)

    class autocast:
        def __init__(self, enabled, recipe):
            calls.append(("autocast", enabled, recipe))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    te_root = types.ModuleType("transformer_engine")
    te_root.__version__ = "2.5.0+abc123"
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.Linear, te_pt.autocast = Linear, autocast
    # TE's availability checks as a Hopper GPU with CUDA 12.9 answers them
    te_pt.is_fp8_available = lambda return_reason=False: (True, "")
    te_pt.is_fp8_block_scaling_available = lambda return_reason=False: (True, "")
    te_pt.is_mxfp8_available = lambda return_reason=False: (
        False,
        "Device compute capability 10.0 or higher required for MXFP8 execution.",
    )
    te_common = types.ModuleType("transformer_engine.common")
    te_common.recipe = recipe_mod
    te_root.pytorch, te_root.common = te_pt, te_common
    for name, mod in [
        ("transformer_engine", te_root),
        ("transformer_engine.pytorch", te_pt),
        ("transformer_engine.common", te_common),
        ("transformer_engine.common.recipe", recipe_mod),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    return calls


def test_te_glue_with_a_stand_in_module(monkeypatch):
    calls = _fake_te(monkeypatch)
    te_backend.check_available("te_delayed", "cuda")
    with pytest.raises(
        UserError,
        match=r"te_mxfp8 is not supported on this GPU \(compute capability 9.0, CUDA .*\): "
        r"Device compute capability 10.0 or higher required for MXFP8 execution.",
    ):
        te_backend.check_available("te_mxfp8", "cuda")
    r = te_backend.make_recipe("te_delayed", FP8_CFG)
    assert type(r).__name__ == "DelayedScaling"
    assert r.kw == {
        "margin": 0,
        "fp8_format": "HYBRID",
        "amax_history_len": 4,
        "amax_compute_algo": "max",
    }
    assert type(te_backend.make_recipe("te_block", FP8_CFG)).__name__ == "Float8BlockScaling"
    make = te_backend.linear_factory(torch.device("cpu"))
    assert isinstance(make("blocks.0.attn.wq", 64, 32, False), nn.Linear)
    with te_backend.autocast_factory("te_current", FP8_CFG, "fp32", torch.device("cpu"))():
        pass
    assert calls[0] == ("Linear", 64, 32, False, torch.float32, "cpu")
    assert (
        calls[1][0] == "autocast"
        and calls[1][1] is True
        and type(calls[1][2]).__name__ == "Float8CurrentScaling"
    )


def test_torchao_linear_is_close_to_fp32():
    make = backends.torchao_linear("torchao_tensorwise", emulate=True)
    torch.manual_seed(0)
    layer = make("x", 64, 32, False)
    ref = nn.Linear(64, 32, bias=False)
    ref.weight.data.copy_(layer.weight.data)
    x = torch.randn(8, 64)
    rel = (layer(x) - ref(x)).norm() / ref(x).norm()
    assert type(layer).__name__ == "Float8Linear" and 0 < rel < 0.1  # FP8 error: present, small
    assert backends.to_high_precision(layer) and torch.allclose(layer(x), ref(x))


def _trainer(tmp_path: Path, callbacks=()):
    cfg = OmegaConf.create({"seed": 0})
    writer = RunWriter(tmp_path)
    ctx = RankContext(
        cfg, DistEnv(0, 1, 0, 1, "127.0.0.1", 0), torch.device("cpu"), "gloo", tmp_path, writer
    )
    train = TrainConfig(steps=4, micro_batch=2, strategy="single", dataset_tokens=5000, log_every=0)
    factory = backends.emulated_linear("emulated_delayed", FP8_CFG)
    return Trainer(
        ctx,
        train,
        GPTConfig.from_preset("tiny"),
        linear_factory=factory,
        callbacks=callbacks,
        peak_flops=(1e12, "test"),
    )


def test_ladder_cuts_lr_then_rolls_back_to_the_checkpointed_state(tmp_path):
    guard = NanGuard(
        OmegaConf.structured(
            GuardConfig(
                lr_cut_after=1,
                lr_cut_factor=0.5,
                lr_restore_after=0,
                rollback_after=2,
                to_high_precision=True,
                checkpoint_every=0,
                max_rollbacks=2,
                report_params=4,
            )
        )
    )
    trainer = _trainer(tmp_path, [guard])
    guard.on_train_start(trainer)  # saves step 0
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_step()
    trainer.train_step()
    assert not torch.equal(trainer.model.lm_head.weight, saved["lm_head.weight"])
    guard.on_step_start(trainer, 3)
    guard._flags.append(
        ("activation", "blocks.0.mlp.w1", torch.tensor(False))
    )  # as the forward hook would
    assert guard.before_optimizer_step(trainer, 3, float("nan"), float("nan")) is False
    assert trainer.lr_scale == 0.5
    trainer.skip_batch()  # what the step's forward would have consumed
    guard.on_step_start(trainer, 4)
    assert guard.before_optimizer_step(trainer, 4, float("inf"), float("nan")) is False
    guard.on_step_end(trainer, 4, {})
    assert trainer.step == 0 and trainer.lr_scale == 0.5  # rolled back; the LR cut stays
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, saved[k]), k  # weights, and the FP8 amax histories with them
    assert guard.skip_positions == {2, 3} and guard.switched == ["blocks.0.mlp.w1"]
    assert trainer.model.blocks[0].mlp.w1.fp8_enabled is False
    guard.on_step_start(trainer, 1)  # position 0 is not a bad batch: nothing skipped
    assert trainer.batcher.step == 0


def test_fault_config_errors_name_the_problem():
    names = {"blocks.0.mlp.w1"}
    with pytest.raises(UserError, match=r"faults\[0\].layer='nope' is not a module"):
        faults.check([{"step": 1, "layer": "nope"}], names)
    with pytest.raises(UserError, match=r"faults\[0\].kind='zero'"):
        faults.check([{"step": 1, "layer": "blocks.0.mlp.w1", "kind": "zero"}], names)
    t = faults.corrupt(torch.ones(3), "inf", 1.0)
    assert torch.isinf(t[0]) and t[1] == 1


def test_inspect_ranks_the_bad_layer_first_and_suggests_current_scaling():
    rows = []
    for recipe, over in (("delayed", 5.0), ("current", 0.0)):
        rows.append(
            dict(
                step=10,
                layer="blocks.1.mlp.w2",
                tensor="gradient",
                recipe=recipe,
                mse=1e-4,
                rel_mse=0.1,
                underflows_pct=1.0,
                overflows_pct=over,
                cos_sim=0.999,
            )
        )
        rows.append(
            dict(
                step=10,
                layer="blocks.0.attn.wq",
                tensor="activation",
                recipe=recipe,
                mse=1e-4,
                rel_mse=1e-3,
                underflows_pct=0.1,
                overflows_pct=0.0,
                cos_sim=0.9999,
            )
        )
    ranked = inspect.rank_layers(pd.DataFrame(rows), "emulated_delayed", dict(inspect.DEFAULTS))
    top = ranked.iloc[0]
    assert top.layer == "blocks.1.mlp.w2" and top.verdict == "bad" and top.cause == "overflow"
    assert "current scaling" in top.suggestion
    assert ranked.iloc[1].verdict == "healthy"
    sev, cause = inspect.severity(
        dict(mse=1e3, underflows_pct=0, overflows_pct=0, cos_sim=1.0), inspect.DEFAULTS
    )
    assert (sev, cause) == (pytest.approx(1.0), "mse")  # mse_bad is exactly severity 1


def test_compare_within_noise_is_the_stated_band():
    runs = pd.DataFrame(
        {
            "recipe": ["fp32"] * 3 + ["a"] * 3 + ["b"] * 3,
            "summary.final_loss": [3.0, 3.1, 3.2, 3.15, 3.2, 3.25, 3.5, 3.5, 3.5],
            "summary.tokens_per_s": [100] * 3 + [150] * 3 + [50] * 3,
            "summary.peak_mem_bytes": [1000] * 3 + [800] * 3 + [1000] * 3,
            "summary.nan_events": [0] * 9,
        }
    )
    agg = compare.aggregate(runs, "fp32", 2.0)  # band: 3.1 +- 2 * 0.1
    assert agg["a"]["within_noise"] and not agg["b"]["within_noise"]
    assert agg["a"]["speedup"] == pytest.approx(1.5) and agg["a"]["memory_factor"] == pytest.approx(
        0.8
    )
    assert agg["fp32"]["final_loss_std"] == pytest.approx(0.1)
