"""Expert parallelism in the shared trainer: world_size=2 train.ep=2 equals world_size=1 (fp32,
gloo, dropless: losses and grad norms within 1e-6 relative, the expert gradients scaled and their
norm counted once), with FSDP2 zero2 / zero3, activation checkpointing and ep folded from cp
ranks (and, slow, on 4 ranks with the experts FSDP2-sharded over efsdp); the run records ep and the
overload factor; bad EP layouts are one-line errors.

Several trainings run inside one launch (each spawn costs seconds): the tiny GPT with 2 layers,
4 experts, top-2, global batch 4 = micro-batches of 1."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import few_steps, local_cpu_run
from dtrain.core.errors import UserError
from dtrain.model.gpt import GPTConfig
from dtrain.model.moe_args import MoEArgs
from dtrain.run.launch import launch
from dtrain.train import Callback, Trainer, TrainConfig

STEPS = 4
MOE = {"experts": 4, "top_k": 2}
REL = 1e-6  # fp32; the sums run in another order on two ranks


def model_of(**moe) -> GPTConfig:
    return GPTConfig.from_preset("tiny", n_layer=2, moe=MoEArgs(**{**MOE, **moe}))


def train_of(**kw) -> TrainConfig:
    return few_steps(STEPS, **{"strategy": "zero3", **kw})


class Seen(Callback):
    def __init__(self):
        self.losses, self.grad_norms, self.overload = [], [], []

    def on_step_end(self, trainer, step, metrics):
        self.losses.append(metrics["loss"])
        self.grad_norms.append(metrics["grad_norm"])
        self.overload.append(metrics["moe_overload"])


def many(ctx) -> dict:
    out = {}
    for name, spec in ctx.cfg.specs.items():
        spec = OmegaConf.to_container(spec)
        seen = Seen()
        moe = spec.pop("moe", {})  # before train_of(**spec), which takes no model keys
        trainer = Trainer(ctx, train_of(**spec), model_of(**moe), callbacks=[seen])
        result = trainer.run()
        out[name] = {
            "losses": seen.losses,
            "grad_norms": seen.grad_norms,
            "overload": seen.overload,
            "result": {k: result.get(k) for k in ("ep", "moe_overload_mean", "dp")},
        }
    return out


def run_specs(tmp_path, world_size: int, specs: dict, name: str = "") -> dict:
    cfg = local_cpu_run(world_size, timeout_s=300, specs=specs)
    run_dir = tmp_path / f"ws{world_size}{name}"
    run_dir.mkdir()
    return launch(many, cfg, run_dir)[0]


def max_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_ep2_matches_one_rank_dropless(tmp_path):
    one = run_specs(tmp_path, 1, {"single": {"strategy": "single"}})["single"]
    two = run_specs(
        tmp_path,
        2,
        {
            "ep2": {"ep": 2},
            "ep2_zero2": {"ep": 2, "strategy": "zero2"},
            "ep2_block_ac": {"ep": 2, "activation_checkpointing": "block"},
            "cp2_ep2": {"ep": 2, "cp": 2, "cp_impl": "ring"},  # ep folded from the cp ranks
            "ep1": {},
        },
    )
    assert one["losses"][-1] < one["losses"][0]
    for name, res in two.items():
        for key in ("losses", "grad_norms"):
            err = max_rel(res[key], one[key])
            print(f"{name} {key} max rel diff {err:.1e}")
            assert err <= REL, (name, key, res[key], one[key])
    assert two["ep2"]["result"]["ep"] == 2 and two["ep1"]["result"]["ep"] == 1
    assert all(o >= 1.0 for o in two["ep2"]["overload"])
    assert two["ep2"]["result"]["moe_overload_mean"] >= 1.0


def test_checkpoints_resume_across_ep(tmp_path):
    """An ep2 checkpoint resumed on one rank, and a one-rank checkpoint resumed on ep2 (DCP
    reshards the experts' (E, ., .) DTensors), continue the one-rank run within 1e-6."""
    ck1, ck2 = str(tmp_path / "ck1"), str(tmp_path / "ck2")
    first = run_specs(tmp_path, 2, {"ep2": {"ep": 2, "checkpoint_every": 2, "checkpoint_dir": ck2}})
    one = run_specs(
        tmp_path,
        1,
        {
            "single": {"strategy": "single", "checkpoint_every": 2, "checkpoint_dir": ck1},
            "single_from_ep2": {"strategy": "single", "resume_from": f"{ck2}/step-000002"},
        },
    )
    two = run_specs(
        tmp_path, 2, {"ep2_from_single": {"ep": 2, "resume_from": f"{ck1}/step-000002"}}, "b"
    )
    ref = one["single"]
    for name, res in (
        ("single_from_ep2", one["single_from_ep2"]),
        ("ep2_from_single", two["ep2_from_single"]),
    ):
        for key in ("losses", "grad_norms"):
            err = max_rel(res[key], ref[key][2:])
            print(f"{name} {key} max rel diff {err:.1e}")
            assert err <= REL, (name, key)
    assert max_rel(first["ep2"]["losses"], ref["losses"]) <= REL


@pytest.mark.slow  # 4 ranks on 2 cores: ~50 s; the 2-rank test above is the fast one
def test_four_ranks_experts_sharded_over_efsdp_and_folded_from_cp_match_one_rank(tmp_path):
    """ep2 x efsdp2 (each rank's experts FSDP2-sharded over 2 ranks: the efsdp average and the 1/ep
    scale), ep4, and cp2 x ep4 (ep folded from dp_shard x cp)."""
    one = run_specs(tmp_path, 1, {"single": {"strategy": "single"}})["single"]
    four = run_specs(
        tmp_path,
        4,
        {
            "ep2_efsdp2": {"ep": 2},
            "ep4": {"ep": 4},
            "cp2_ep4": {"ep": 4, "cp": 2, "cp_impl": "ring"},
        },
    )
    for name, res in four.items():
        for key in ("losses", "grad_norms"):
            err = max_rel(res[key], one[key])
            print(f"{name} {key} max rel diff {err:.1e}")
            assert err <= REL, (name, key)


@pytest.mark.slow  # torch.compile on CPU: ~30 s
def test_ep2_compiled_matches_one_rank(tmp_path):
    """train.compile: each block compiled, the all-to-all dispatch left eager (graph breaks)."""
    one = run_specs(tmp_path, 1, {"single": {"strategy": "single"}})["single"]
    two = run_specs(tmp_path, 2, {"ep2_compile": {"ep": 2, "compile": True}})["ep2_compile"]
    for key in ("losses", "grad_norms"):
        err = max_rel(two[key], one[key])
        print(f"ep2_compile {key} max rel diff {err:.1e}")
        assert err <= REL, key


@pytest.mark.parametrize(
    "world_size, train, moe, message",
    [
        (2, {"ep": 2}, None, "train.ep=2 needs an MoE model: set model.moe.experts (e.g. 4)"),
        (
            2,
            {"ep": 2},
            {"experts": 3, "top_k": 1},
            "model.moe.experts=3 is not divisible by train.ep=2: every ep rank holds the same "
            "number of experts",
        ),
        (
            2,
            {"ep": 4},
            {},
            "train.ep=4 does not divide dp_shard x cp x tp = 2 x 1 x 1: the experts fold from "
            "the attention's sharded data, context and tensor ranks",
        ),
        (2, {"etp": 2}, {}, "train.etp=2: expert tensor parallelism is not implemented: use 1"),
        (
            2,
            {"ep": 2, "activation_checkpointing": "op"},
            {},
            "train.activation_checkpointing=op does not run with train.ep=2: use block or none",
        ),
        (
            2,
            {"tp": 2},
            {"aux_loss_coef": 0.01},
            "model.moe.aux_loss_coef=0.01 does not run with train.tp=2 (each tp rank routes its "
            "share of the tokens): use 0 (the sigmoid router balances without it) or train.tp=1",
        ),
        (
            2,
            {"ep": 2, "strategy": "ddp"},
            {},
            "train.ep=2 does not divide dp_shard x cp x tp = 1 x 1 x 1: the experts fold from "
            "the attention's sharded data, context and tensor ranks",
        ),
    ],
)
def test_bad_ep_layouts_are_one_line_errors(world_size, train, moe, message):
    model = GPTConfig.from_preset("tiny") if moe is None else model_of(**moe)
    with pytest.raises(UserError) as e:
        t = train_of(**train).resolved(world_size)
        t.validate_model(model)
    assert str(e.value) == message
