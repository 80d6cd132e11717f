"""Context parallelism in the shared trainer (train.cp): cp ranks of one replica share each
sequence (zigzag shards), so losses and grad norms equal the single-process run's (fp32, gloo,
within 1e-6 relative, as every layout in test_train_layouts); a DCP checkpoint resumes across a
change of cp; what cannot run is one line before any rank starts; and the implementation a run
uses (ring | ulysses | PyTorch's context_parallel) is chosen, and recorded, as documented.

The model and data are test_train_layouts' (tiny GPT, 4 layers, global batch 4 of seq 64)."""

from __future__ import annotations

import pytest

from dtrain.core.errors import UserError
from dtrain.model.gpt import GPTConfig
from dtrain.parallel.cp.trainer_cp import select_impl
from dtrain.parallel.mesh import ParallelDims
from dtrain.train import TrainConfig
import test_train_layouts
from test_train_layouts import assert_matches, run_specs

# pytest fixtures, named as the tests' arguments
reference, references = test_train_layouts.reference, test_train_layouts.references


def test_two_rank_cp_matches_single_and_resumes_across_a_change_of_cp(tmp_path, reference):
    """cp=2 under FSDP2 (over the cp ranks), under DDP, with the all-to-all variant, and a cp=2
    checkpoint resumed at cp=1 (dp2), all against the single process."""
    ck = str(tmp_path / "ck")
    two = run_specs(
        tmp_path,
        2,
        {
            "cp2_zero3": {"cp": 2, "checkpoint_every": 3, "checkpoint_dir": ck},
            "cp2_ddp": {"cp": 2, "strategy": "ddp"},
            "cp2_ulysses_op_ac": {"cp": 2, "cp_impl": "ulysses", "activation_checkpointing": "op"},
            "dp2_from_cp2": {"resume_from": f"{ck}/step-000003"},
        },
    )
    for name in ("cp2_zero3", "cp2_ddp", "cp2_ulysses_op_ac"):
        assert_matches(two[name], reference, name)
    assert_matches(two["dp2_from_cp2"], reference, "dp2_from_cp2", first=3)
    assert two["cp2_zero3"]["result"]["cp"] == 2 and two["cp2_zero3"]["result"]["cp_impl"] == "ring"
    assert two["cp2_ulysses_op_ac"]["result"]["cp_impl"] == "ulysses"


@pytest.mark.slow
def test_a_cp1_checkpoint_resumes_at_cp2(tmp_path, reference):
    """The reverse direction (the fast test above saves at cp=2 and resumes at cp=1)."""
    ck = str(tmp_path / "ck")
    run_specs(
        tmp_path, 1, {"single": {"strategy": "zero3", "checkpoint_every": 2, "checkpoint_dir": ck}}
    )
    two = run_specs(tmp_path, 2, {"cp2_from_cp1": {"cp": 2, "resume_from": f"{ck}/step-000002"}})
    assert_matches(two["cp2_from_cp1"], reference, "cp2_from_cp1", first=2)


@pytest.mark.slow
def test_four_rank_cp_composes_with_dp_tp_and_gqa(tmp_path, references):
    """dp2 x cp2 (FSDP2 over shard x cp), cp2 x tp2 with SP (hand-rolled and DTensor TP), ring at
    cp=4 with one k/v head."""
    four = run_specs(
        tmp_path,
        4,
        {
            "dp2_cp2": {"cp": 2},
            "cp2_tp2_sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
            "cp2_tp2_dtensor": {"cp": 2, "tp": 2, "tp_impl": "dtensor"},
            "cp4_kv1": {"cp": 4, "model": {"n_kv_head": 1}},
        },
    )
    for name in ("dp2_cp2", "cp2_tp2_sp", "cp2_tp2_dtensor"):
        assert_matches(four[name], references["single"], name)
    assert_matches(four["cp4_kv1"], references["single_kv1"], "cp4_kv1")


def test_the_mesh_puts_cp_between_shard_and_tp_and_dp_excludes_it():
    dims = ParallelDims.of(16, tp=2, cp=2, strategy="hsdp", hsdp_replicate=2)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.cp) == (4, 2, 2, 2)
    assert [n for n, _ in dims.dims()] == ["replicate", "shard", "cp", "tp"]
    assert dims.describe == "dp4xtp2xpp1xcp2"
    assert TrainConfig(cp=2, strategy="ddp").dims(4).dp_replicate == 2


def test_auto_picks_torch_only_on_cuda_with_nccl():
    assert select_impl("auto", "cuda", "nccl") == "torch"
    assert select_impl("auto", "cpu", "gloo") == "ring"
    assert select_impl("auto", "cuda", "gloo") == "ring"
    assert select_impl("ulysses", "cuda", "nccl") == "ulysses"


@pytest.mark.parametrize(
    "train, world, model, message",
    [
        ({"cp": 2, "pp": 2}, 4, {}, "train.cp=2 with train.pp=2 is not supported"),
        ({"cp": 0}, 2, {}, "train.cp=0 must be an integer >= 1"),
        (
            {"cp": 2, "cp_impl": "flash"},
            2,
            {},
            "train.cp_impl='flash' must be one of auto, ring, ulysses, torch",
        ),
        ({"cp": 3}, 2, {}, "world_size=2 is not divisible by train.tp x train.pp x train.cp"),
        ({"cp": 2}, 2, {"seq_len": 66}, "model.seq_len=66 is not divisible by 2 x cp = 4"),
        (
            {"cp": 2, "cp_impl": "ulysses"},
            2,
            {"n_head": 1},
            "train.cp_impl=ulysses spreads a rank's 1 query heads",
        ),
        (
            {"cp": 2, "tp": 4, "sequence_parallel": True},
            8,
            {"seq_len": 12},
            "6 tokens .* not divisible by train.tp=4",
        ),
    ],
)
def test_layouts_cp_cannot_run_are_one_line(train, world, model, message):
    cfg = TrainConfig(micro_batch=1, **train)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        resolved = cfg.resolved(world, "cpu")
        resolved.validate_model(GPTConfig.from_preset("tiny", **model))


def test_torch_context_parallel_is_refused_off_cuda():
    with pytest.raises(UserError, match="train.cp_impl=torch needs CUDA"):
        TrainConfig(cp=2, cp_impl="torch").resolved(2, "cpu")
    assert TrainConfig(cp=2, cp_impl="torch").resolved(2, "cuda").cp_impl == "torch"


def test_the_memory_check_counts_a_cp_ranks_tokens_and_fsdp_over_cp():
    from dtrain.train.memory_fit import training_need

    model = GPTConfig.from_preset("1b", seq_len=8192)
    need = {
        cp: training_need(model, TrainConfig(cp=cp, micro_batch=1).resolved(4, "cuda"), 4)
        for cp in (1, 2, 4)
    }
    assert (
        need[1].states == need[2].states == need[4].states
    )  # FSDP2 shards over shard x cp = 4 ranks each time
    assert need[4].activations < need[2].activations < need[1].activations  # s / cp tokens per rank
    assert need[2].activations == pytest.approx(need[1].activations / 2, rel=0.05)


@pytest.mark.slow
def test_cli_cp2_equals_one_rank_and_records_cp(tmp_path):
    """The issue's check, as a user runs it: two CLI runs, the same global batch (2 sequences)."""
    from conftest import py
    from dtrain.results import contract, loader

    args = ["model.preset=tiny", "model.seq_len=256", "train.steps=8"]
    for world, extra in ((2, ["train.cp=2"]), (1, [])):
        out = py(
            "-m",
            "fsdp_scaling",
            f"world_size={world}",
            *extra,
            *args,
            f"results_dir={tmp_path}/w{world}",
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
    steps = {w: loader.load([tmp_path / f"w{w}"], kind="step") for w in (1, 2)}
    for key in ("loss", "grad_norm"):
        rel = max(abs(a - b) / abs(b) for a, b in zip(steps[2][key], steps[1][key], strict=True))
        assert rel <= 1e-6, (key, rel)
    [run] = loader.complete_runs([tmp_path / "w2"])
    assert (run.summary["cp"], run.summary["cp_impl"], run.summary["global_batch"]) == (
        2,
        "ring",
        2,
    )
    [m] = contract.read(run.summary)
    assert (m.layout.cp, m.layout.dp, m.layout.world_size) == (2, 1, 2)


def test_cp_refuses_an_attention_that_is_not_dtrain_models_sdpa():
    from dtrain.model.gpt import GPT
    from dtrain.parallel.cp.trainer_cp import swap_attention_cores

    gpt = GPT(GPTConfig.from_preset("tiny"))
    gpt.blocks[1].attn.core = lambda q, k, v, head_dim: q  # e.g. an experiment's own attention
    with pytest.raises(
        UserError,
        match=r"needs dtrain.model.gpt's SDPA attention in every block, but blocks.1.attn runs",
    ):
        swap_attention_cores(gpt, "ring", mesh=None)
