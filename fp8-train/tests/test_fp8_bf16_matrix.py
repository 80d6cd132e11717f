"""Every FP8 recipe that runs on CPU x every data-parallel strategy, under train.precision=bf16 (CPU
autocast for single/ddp, FSDP2's MixedPrecisionPolicy for zero2/zero3): a few steps of the real
fp8_train rank function with finite, decreasing loss. Plus the emulated Linear's dtypes and its
exactness under activation checkpointing.

Several trainings share one launch (a spawn costs seconds); each gets its own run directory.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from dtrain.core.nodes import defaults
from dtrain.model.gpt import GPT, GPTConfig
from dtrain.results.loader import read_jsonl
from dtrain.results.metrics import RunWriter
from dtrain.run.launch import launch
from dtrain.run.rank import RankContext
from fp8_train import backends
from fp8_train import train as fp8_train_run
from fp8_train.conf import Fp8TrainConfig
from fp8_train.emulated import FP8Linear, fp8_layers

SEED = 0
STEPS = 5
RECIPES = ("emulated_delayed", "emulated_current", "torchao_tensorwise")


def fp8_cfg(world_size: int, **extra) -> OmegaConf:
    """fp8_train's config (its dataclass's defaults), small and quiet."""
    cfg = OmegaConf.merge(
        defaults(Fp8TrainConfig),
        {
            "launcher": "local",
            "world_size": world_size,
            "backend": "gloo",
            "device": "cpu",
            "seed": SEED,
            "dist_timeout_s": 120,
            "threads_per_rank": 1,
            "train": {
                "steps": STEPS,
                "micro_batch": 2,
                "warmup_steps": 1,
                "log_every": 0,
                "timing_warmup": 0,
                "dataset_tokens": 20_000,
                "lr": 3e-3,
                "precision": "bf16",
            },
            "fp8_debug": {"enabled": False},
            "health": {"enabled": False},
            "guard": {"enabled": False},
        },
        extra,
    )
    return cfg


def many_runs(ctx) -> dict:
    """fp8_train.train.rank_fn once per spec in ctx.cfg.specs; per spec its step losses."""
    out = {}
    for name, spec in ctx.cfg.specs.items():
        cfg = OmegaConf.merge(ctx.cfg, OmegaConf.from_dotlist(list(spec)))
        run_dir = ctx.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        ctx.barrier()
        with RunWriter(run_dir, ctx.rank) as writer:
            result = fp8_train_run.rank_fn(
                RankContext(cfg, ctx.env, ctx.device, ctx.backend, run_dir, writer)
            )
        ctx.barrier()
        if ctx.is_main:
            rows = [r for r in read_jsonl(run_dir / "records.jsonl") if r.get("kind") == "step"]
            out[name] = {"losses": [r["loss"] for r in rows], "precision": result["precision"]}
    return out


def run_matrix(tmp_path: Path, world_size: int, specs: dict[str, list[str]]) -> dict:
    print(f"seed={SEED}")
    run_dir = tmp_path / f"ws{world_size}"
    run_dir.mkdir()
    cfg = fp8_cfg(world_size, specs=specs)
    return launch(many_runs, cfg, run_dir)[0]


def check_learns(results: dict, names) -> None:
    for name in names:
        r = results[name]
        losses = r["losses"]
        assert r["precision"] == "bf16", name
        assert len(losses) == STEPS and all(v is not None and math.isfinite(v) for v in losses), (
            name,
            losses,
        )
        assert losses[-1] < losses[0] - 0.05, (name, losses)  # ln(256) = 5.55 at init; it learns


def specs_for(pairs) -> dict[str, list[str]]:
    return {
        f"{recipe}-{strategy}": [f"recipe={recipe}", f"train.strategy={strategy}"]
        for recipe, strategy in pairs
    }


# The whole matrix is cheap (tiny GPT, 5 steps, ~10 s per launch), so it stays in the fast path.
SINGLE = [(r, "single") for r in RECIPES]
MULTI = [(r, s) for r in RECIPES for s in ("ddp", "zero2", "zero3")]


def test_each_recipe_trains_in_bf16_single_rank(tmp_path):
    specs = specs_for(
        SINGLE + [("emulated_nvfp4", "single"), ("emulated_mxfp4", "single")]
    )  # FP4 too
    specs["emulated_delayed-single-ac"] = [
        "recipe=emulated_delayed",
        "train.strategy=single",
        "train.activation_checkpointing=block",
    ]
    check_learns(run_matrix(tmp_path, 1, specs), specs)


@pytest.mark.slow  # every recipe x strategy; the single-rank recipe test stays in the fast path
def test_recipe_x_strategy_matrix_trains_in_bf16_on_two_ranks(tmp_path):
    specs = specs_for(MULTI)
    specs["emulated_delayed-zero3-ac"] = [
        "recipe=emulated_delayed",
        "train.strategy=zero3",
        "train.activation_checkpointing=block",
    ]
    check_learns(run_matrix(tmp_path, 2, specs), specs)


# ---------------------------------------------------------------- the emulated Linear's dtypes


def _layer(scaling="delayed", dtype=torch.float32) -> FP8Linear:
    torch.manual_seed(SEED)
    return FP8Linear(64, 32, bias=True, scaling=scaling, history_len=4, dtype=dtype)


def test_emulated_linear_under_cpu_bf16_autocast_has_the_right_dtypes():
    print(f"seed={SEED}")
    layer = _layer()
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(SEED), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        ref = nn.functional.linear(
            x, layer.weight, layer.bias
        )  # what nn.Linear gives under autocast
    assert y.dtype == ref.dtype == torch.bfloat16
    y.float().square().sum().backward()
    # gradients in the dtype of what they belong to: fp32 master weights, fp32 input
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    assert (y.float() - ref.float()).norm() / ref.float().norm() < 0.1  # FP8 error: small
    # the matmul ran on the FP8-rounded bf16 operands: every input value is on E4M3's grid / scale
    assert layer.input_scaler.amax_history[0] == x.detach().to(torch.bfloat16).abs().max().float()


def test_emulated_linear_with_bf16_weights_as_fsdp2_gives_them_gets_bf16_grads():
    layer = _layer(
        scaling="current", dtype=torch.bfloat16
    )  # FSDP2 MixedPrecisionPolicy: bf16 params + inputs
    x = (
        torch.randn(16, 64, generator=torch.Generator().manual_seed(SEED))
        .bfloat16()
        .requires_grad_()
    )
    y = layer(x)
    y.float().sum().backward()
    assert (
        y.dtype
        == x.grad.dtype
        == layer.weight.grad.dtype
        == layer.bias.grad.dtype
        == torch.bfloat16
    )
    # bias gradient: sum of the output gradient (all ones) over the 16 rows, exactly
    assert torch.equal(layer.bias.grad, torch.full((32,), 16.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("recipe", ["emulated_delayed", "emulated_current"])
def test_activation_checkpointing_gives_the_same_grads_and_records_each_amax_once(recipe):
    """A recomputed forward must see the same FP8 operands: delayed scaling would otherwise take a
    scale that already includes this step's amax, and push the amax into the history twice."""
    from dtrain.train.parallelize import apply_activation_checkpointing

    print(f"seed={SEED}")
    cfg = GPTConfig.from_preset("tiny")
    make = backends.emulated_linear(
        recipe,
        OmegaConf.create(
            {
                "margin": 0,
                "amax_history_len": 4,
                "amax_compute_algo": "max",
                "e5m2_overflow": "saturate",
            }
        ),
    )
    models = []
    for ac in (False, True):
        torch.manual_seed(SEED)
        model = GPT(cfg, make)
        if ac:
            apply_activation_checkpointing(model)
        models.append(model)
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED)
    )
    for _ in range(3):  # three steps: the delayed histories fill, scales move
        for model in models:
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
    plain, checkpointed = models
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, a), b in zip(fp8_layers(plain).items(), fp8_layers(checkpointed).values()):
        for scaler in ("input_scaler", "weight_scaler", "grad_output_scaler"):
            assert torch.equal(getattr(a, scaler).scale, getattr(b, scaler).scale), (name, scaler)
            if recipe == "emulated_delayed":
                history = getattr(b, scaler).amax_history
                assert torch.equal(getattr(a, scaler).amax_history, history), (name, scaler)
                assert int((history > 0).sum()) == 3, (name, scaler)  # one amax per step, not two


# ---------------------------------------------------------------- train.compile


def test_compile_is_in_place_per_block_and_keeps_names():
    from dtrain.train.parallelize import apply_compile

    model = GPT(
        GPTConfig.from_preset("tiny"),
        backends.emulated_linear(
            "emulated_delayed",
            OmegaConf.create(
                {
                    "margin": 0,
                    "amax_history_len": 4,
                    "amax_compute_algo": "max",
                    "e5m2_overflow": "saturate",
                }
            ),
        ),
    )
    keys = list(model.state_dict())
    apply_compile(model)  # lazy: nothing compiles until the first forward
    assert list(model.state_dict()) == keys and all(
        b._compiled_call_impl is not None for b in model.blocks
    )


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_under_fsdp2_and_fp8(tmp_path):
    """train.compile=true (inductor on CPU needs a C compiler) with zero3, bf16 and two FP8 recipes:
    the same losses as eager within bf16 noise."""
    specs = {}
    for recipe in ("emulated_delayed", "torchao_tensorwise"):
        for compiled in (False, True):
            specs[f"{recipe}-{compiled}"] = [
                f"recipe={recipe}",
                "train.strategy=zero3",
                f"train.compile={compiled}",
            ]
    results = run_matrix(tmp_path, 2, specs)
    check_learns(results, specs)
    for recipe in ("emulated_delayed", "torchao_tensorwise"):
        eager, compiled = results[f"{recipe}-False"]["losses"], results[f"{recipe}-True"]["losses"]
        assert compiled == pytest.approx(eager, abs=2e-2), (recipe, eager, compiled)
