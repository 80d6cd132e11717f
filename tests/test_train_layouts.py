"""DP x TP (+SP) x PP in the shared trainer: 5-step losses and grad norms equal the single-process
run's (fp32, gloo, within 1e-6 relative: a mis-scaled gradient shows in the norm even where Adam
hides it in the loss), checkpoints resume exactly on the same and on another layout, bad layouts
are one-line errors. Both TP implementations (train.tp_impl: the hand-rolled layers and the DTensor
plan). Also GQA with fewer k/v heads than tp ranks, and the async input-grad overlap
(train.async_grad_allreduce).

Several trainings run inside one launch (each spawn costs seconds); the model is the tiny GPT
with 4 layers (so 2 ranks x 2 virtual stages fit), global batch 4 = 4 micro-batches of 1."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import few_steps, local_cpu_run
from dtrain.core.errors import UserError
from dtrain.model.gpt import GPTConfig
from dtrain.run.launch import launch
from dtrain.train import Callback, Trainer, TrainConfig

STEPS = 5
MODEL = GPTConfig.from_preset("tiny", n_layer=4)
GQA = {"n_kv_head": 1}  # a spec's "model": overrides of MODEL (here one k/v head: kv_heads < tp)


def base_cfg(world_size: int, **extra):
    return local_cpu_run(world_size, timeout_s=300, **extra)


def train_of(**kw) -> TrainConfig:
    return few_steps(STEPS, **{"strategy": "zero3", **kw})


class Losses(Callback):
    def __init__(self):
        self.losses, self.grad_norms = [], []

    def on_step_end(self, trainer, step, metrics):
        self.losses.append(metrics["loss"])
        self.grad_norms.append(metrics["grad_norm"])


def many_layouts(ctx) -> dict:
    """Every layout in ctx.cfg.specs in turn: its per-step losses, grad norms, last checkpoint."""
    out = {}
    for name, spec in ctx.cfg.specs.items():
        seen = Losses()
        spec = OmegaConf.to_container(spec)
        model = GPTConfig.from_preset("tiny", **{"n_layer": 4, **spec.pop("model", {})})
        trainer = Trainer(ctx, train_of(**spec), model, callbacks=[seen])
        result = trainer.run()
        out[name] = {
            "losses": seen.losses,
            "grad_norms": seen.grad_norms,
            "checkpoint": trainer.last_checkpoint,
            "result": {k: result[k] for k in ("dp", "tp", "pp", "cp", "cp_impl")},
        }
    return out


def run_specs(tmp_path, world_size: int, specs: dict) -> dict:
    run_dir = tmp_path / f"ws{world_size}-{'-'.join(specs)}"
    run_dir.mkdir()
    return launch(many_layouts, base_cfg(world_size, specs=specs), run_dir)[0]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """The single-process runs, in one launch: MODEL, and MODEL with one k/v head (GQA)."""
    got = run_specs(
        tmp_path_factory.mktemp("ref"),
        1,
        {"single": {"strategy": "single"}, "single_kv1": {"strategy": "single", "model": GQA}},
    )
    for res in got.values():
        assert len(res["losses"]) == STEPS and res["losses"][-1] < res["losses"][0]
    return got


@pytest.fixture(scope="module")
def reference(references) -> dict:
    """The single-process losses and grad norms every layout must reproduce."""
    return references["single"]


REL = 1e-6  # fp32: measured here at most a few 1e-7 (sum orders differ between layouts)


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def assert_matches(res: dict, ref: dict, name: str, first: int = 0) -> None:
    """Losses and grad norms of every step equal the reference's (from step `first` on) to REL."""
    for key in ("losses", "grad_norms"):
        err = max_rel(res[key], ref[key][first:])
        print(f"{name} {key} max rel diff {err:.1e}")
        assert err <= REL, (name, key, res[key], ref[key][first:])


def test_two_rank_tp_and_pipeline_schedules_match_single(tmp_path, reference):
    two = run_specs(
        tmp_path,
        2,
        {
            "tp2": {"tp": 2},
            "tp2_sp": {"tp": 2, "sequence_parallel": True},
            "tp2_sp_op_ac": {"tp": 2, "sequence_parallel": True, "activation_checkpointing": "op"},
            "tp2_dtensor": {"tp": 2, "tp_impl": "dtensor"},
            "tp2_sp_dtensor": {"tp": 2, "sequence_parallel": True, "tp_impl": "dtensor"},
            "pp2_1f1b": {"pp": 2, "pp_schedule": "1f1b"},
            "pp2_interleaved_1f1b": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual": 2},
        },
    )
    for name, res in two.items():
        assert_matches(res, reference, name)


@pytest.mark.slow  # the fast path keeps a shorter test of the same property
def test_four_rank_2d_layouts_match_single_and_resume_across_layouts(tmp_path, reference):
    """dp2 x tp2 (FSDP2 over dp on top of TP, both TP implementations), tp2 x pp2, and a tp2 x pp2
    checkpoint resumed on dp4."""
    ck = str(tmp_path / "ck")
    four = run_specs(
        tmp_path,
        4,
        {
            "dp2_tp2": {"tp": 2},
            "dp2_tp2_sp_dtensor": {"tp": 2, "sequence_parallel": True, "tp_impl": "dtensor"},
            "tp2_pp2": {"tp": 2, "pp": 2, "checkpoint_every": 3, "checkpoint_dir": ck},
            "dp4_from_tp2_pp2": {"resume_from": f"{ck}/step-000003"},
        },
    )
    for name in ("dp2_tp2", "dp2_tp2_sp_dtensor", "tp2_pp2"):
        assert_matches(four[name], reference, name)
    assert_matches(four["dp4_from_tp2_pp2"], reference, "dp4_from_tp2_pp2", first=3)


@pytest.mark.slow
def test_more_layouts_match_single_and_resume(tmp_path, reference):
    ck = str(tmp_path / "ck")
    two = run_specs(
        tmp_path,
        2,
        {
            "pp2_gpipe": {"pp": 2, "pp_schedule": "gpipe"},
            "pp2_interleaved_zb": {"pp": 2, "pp_schedule": "interleaved_zb", "pp_virtual": 2},
            "pp2_zbv": {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2},
            "tp2_ac": {
                "tp": 2,
                "activation_checkpointing": "block",
                "checkpoint_every": 3,
                "checkpoint_dir": ck,
            },
            "tp2_resumed": {"tp": 2, "resume_from": f"{ck}/step-000003"},
            "pp2_interleaved_from_tp2": {
                "pp": 2,
                "pp_schedule": "interleaved_1f1b",
                "pp_virtual": 2,
                "resume_from": f"{ck}/step-000003",
            },
        },
    )
    four = run_specs(
        tmp_path,
        4,
        {
            "dp2_pp2": {"pp": 2, "checkpoint_every": 3, "checkpoint_dir": ck + "4"},
            "dp2_pp2_resumed": {"pp": 2, "resume_from": f"{ck}4/step-000003"},
            "dp2_pp2_zbv": {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2},
            "dp2_tp2_ddp": {"tp": 2, "strategy": "ddp"},
            "dp2_tp2_zero2": {"tp": 2, "strategy": "zero2"},
            "dp2_tp2_sp": {"tp": 2, "sequence_parallel": True},
            "tp2_pp2_sp_interleaved_zb": {
                "tp": 2,
                "pp": 2,
                "sequence_parallel": True,
                "pp_schedule": "interleaved_zb",
                "pp_virtual": 2,
            },
            "dp2_pp2_interleaved_ddp": {
                "pp": 2,
                "strategy": "ddp",
                "pp_schedule": "interleaved_1f1b",
                "pp_virtual": 2,
            },
        },
    )
    one = run_specs(
        tmp_path,
        1,
        {"single_from_dp2_pp2": {"strategy": "single", "resume_from": f"{ck}4/step-000003"}},
    )
    for name in ("pp2_gpipe", "pp2_interleaved_zb", "pp2_zbv", "tp2_ac"):
        assert_matches(two[name], reference, name)
    for name in (
        "dp2_pp2",
        "dp2_pp2_zbv",
        "dp2_tp2_ddp",
        "dp2_tp2_zero2",
        "dp2_pp2_interleaved_ddp",
        "dp2_tp2_sp",
        "tp2_pp2_sp_interleaved_zb",
    ):
        assert_matches(four[name], reference, name)
    for name, resumed in (
        ("tp2_resumed", two),
        ("pp2_interleaved_from_tp2", two),
        ("dp2_pp2_resumed", four),
        ("single_from_dp2_pp2", one),
    ):
        assert_matches(resumed[name], reference, name, first=3)


def single_run(tmp_path_factory, n_kv_head: int) -> dict:
    spec = {"strategy": "single", "model": {"n_kv_head": n_kv_head}}
    return run_specs(tmp_path_factory.mktemp(f"kv{n_kv_head}"), 1, {"single": spec})["single"]


@pytest.fixture(scope="module")
def gqa_reference(references) -> dict:
    """Single-process losses and grad norms of the one-k/v-head model the kv_heads < tp layouts
    train."""
    return references["single_kv1"]


def test_kv_heads_below_tp_with_async_grad_allreduce_matches_single(tmp_path, gqa_reference):
    """One k/v head on tp2 (replicated wk/wv, gradients summed over tp) with the async input-grad
    overlap: the single-process losses and grad norms (the slow test also runs the synchronous
    path)."""
    got = run_specs(
        tmp_path, 2, {"tp2_kv1_async": {"tp": 2, "async_grad_allreduce": True, "model": GQA}}
    )
    assert_matches(got["tp2_kv1_async"], gqa_reference, "tp2_kv1_async")


@pytest.mark.slow
def test_more_kv_heads_below_tp_and_async_layouts_match_single_and_resume(
    tmp_path, tmp_path_factory, gqa_reference
):
    """Sync vs async on tp2 (equal within 1e-6); SP + async on tp2 and its checkpoint resumed on dp2
    (plain wk/wv, FSDP2); FSDP2 over a replicated-k/v tp2, two k/v heads on tp4 (two ranks per
    head) with SP + async, ddp + async, tp2 x pp2 + async."""
    ck, kv2 = str(tmp_path / "ck"), {"n_kv_head": 2}
    two = run_specs(
        tmp_path,
        2,
        {
            "tp2_kv1": {"tp": 2, "model": GQA},
            "tp2_kv1_async": {"tp": 2, "async_grad_allreduce": True, "model": GQA},
            "tp2_kv1_sp_async": {
                "tp": 2,
                "sequence_parallel": True,
                "async_grad_allreduce": True,
                "model": GQA,
                "checkpoint_every": 3,
                "checkpoint_dir": ck,
            },
            "dp2_from_tp2_kv1": {"model": GQA, "resume_from": f"{ck}/step-000003"},
        },
    )
    four = run_specs(
        tmp_path,
        4,
        {
            "dp2_tp2_kv1": {"tp": 2, "model": GQA},
            "tp4_kv2_sp_async": {
                "tp": 4,
                "sequence_parallel": True,
                "async_grad_allreduce": True,
                "model": kv2,
            },
            "dp2_tp2_kv1_ddp_async": {
                "tp": 2,
                "strategy": "ddp",
                "async_grad_allreduce": True,
                "model": GQA,
            },
            "tp2_pp2_kv1_async": {"tp": 2, "pp": 2, "async_grad_allreduce": True, "model": GQA},
        },
    )
    kv2_reference = single_run(tmp_path_factory, 2)
    assert max_rel(two["tp2_kv1_async"]["losses"], two["tp2_kv1"]["losses"]) <= REL  # async == sync
    assert_matches(two["dp2_from_tp2_kv1"], gqa_reference, "dp2_from_tp2_kv1", first=3)
    for name, res in {**{k: two[k] for k in ("tp2_kv1", "tp2_kv1_sp_async")}, **four}.items():
        assert_matches(res, kv2_reference if name.startswith("tp4_kv2") else gqa_reference, name)


@pytest.mark.parametrize(
    "world_size,overrides,model,message",
    [
        (4, {"tp": 3}, MODEL, "world_size=4 is not divisible by train.tp x train.pp = 3 x 1"),
        (8, {"tp": 8}, MODEL, "train.tp=8: n_head=4 is not divisible by tp=8"),
        (
            6,
            {"tp": 6},
            GPTConfig.from_preset("tiny", d_model=96, n_head=12, n_kv_head=4),
            "train.tp=6: tp=6 is not a multiple of n_kv_head=4",
        ),
        (
            2,
            {"async_grad_allreduce": True},
            MODEL,
            "train.async_grad_allreduce=true needs train.tp > 1",
        ),
        (
            4,
            {"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_virtual": 2, "global_batch": 8},
            MODEL,
            "model.n_layer=4 < pipeline stages = train.pp x train.pp_virtual = 4 x 2 = 8",
        ),
        (
            2,
            {"pp": 2, "global_batch": 1},
            MODEL,
            "pipeline micro-batches (train.grad_accum=1) < train.pp=2",
        ),
        (
            2,
            {"pp": 2, "pp_schedule": "zbv"},
            MODEL,
            "train.pp_schedule=zbv needs exactly train.pp_virtual=2",
        ),
        (
            2,
            {"pp": 2, "pp_schedule": "1f1b", "pp_virtual": 2},
            MODEL,
            "train.pp_schedule=1f1b runs one stage per rank",
        ),
        (2, {"pp": 2, "pp_schedule": "interleaved_1f1b"}, MODEL, "needs train.pp_virtual >= 2"),
        (2, {"pp_schedule": "dualpipe"}, MODEL, "train.pp_schedule='dualpipe' is unknown"),
        (2, {"sequence_parallel": True}, MODEL, "train.sequence_parallel=true needs train.tp > 1"),
        (
            2,
            {"tp": 2, "sequence_parallel": True},
            GPTConfig.from_preset("tiny", seq_len=63),
            "model.seq_len=63 is not divisible",
        ),
        (
            2,
            {"pp": 2},
            GPTConfig.from_preset("tiny", n_layer=4, tie_embeddings=True),
            "needs model.tie_embeddings=false",
        ),
        (
            1,
            {"tp": 2, "strategy": "single"},
            MODEL,
            "world_size=1 is not divisible by train.tp x train.pp = 2 x 1",
        ),
        (
            8,
            {"tp": 2, "global_batch": 6},
            MODEL,
            "train.global_batch=6 is not divisible by train.micro_batch x "
            "data-parallel ranks = 1 x 4 = 4",
        ),
        (
            2,
            {"tp": 2, "tp_impl": "dtensor"},
            GPTConfig.from_preset("tiny", n_layer=4, n_kv_head=1),
            "train.tp_impl=dtensor cannot split model.n_kv_head=1 k/v heads over train.tp=2",
        ),
        (
            2,
            {"tp": 2, "tp_impl": "dtensor", "async_grad_allreduce": True},
            MODEL,
            "train.async_grad_allreduce=true is the hand-rolled layers' overlap",
        ),
        (
            2,
            {"tp": 2, "tp_impl": "megatron"},
            MODEL,
            "train.tp_impl='megatron' is unknown: choose one of handrolled, dtensor",
        ),
        (
            6,
            {"strategy": "hsdp", "hsdp_replicate": 4},
            MODEL,
            "dp = world_size / (tp x pp) = 6 ranks do not factor into "
            "train.hsdp_replicate=4 replicas x shards",
        ),
    ],
)
def test_bad_layouts_are_one_line_errors(world_size, overrides, model, message):
    with pytest.raises(UserError) as e:
        train_of(**overrides).resolved(world_size, "cpu").validate_model(model)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_layout_dimensions_and_stage_split():
    from dtrain.parallel.mesh import ParallelDims
    from dtrain.parallel.pipeline import split_layers, stages_of_rank

    dims = ParallelDims(16, tp=2, pp=2, dp_replicate=2)
    assert (dims.dp, dims.dp_shard, dims.describe) == (4, 2, "dp4xtp2xpp2")
    assert dims.dims() == [("pp", 2), ("replicate", 2), ("shard", 2), ("tp", 2)]
    assert ParallelDims(4, tp=2, pp=2).dims() == [("pp", 2), ("tp", 2)]
    assert [len(r) for r in split_layers(7, 3)] == [2, 3, 2] and split_layers(7, 3)[2] == range(
        5, 7
    )
    assert stages_of_rank(1, 4, "zbv", 2) == [1, 6] and stages_of_rank(
        1, 4, "interleaved_1f1b", 2
    ) == [1, 5]


def test_strategies_split_dp_into_replicas_and_shards():
    """ParallelDims.of, the one home of the dp / shard degrees (fit, local_check, fsdp-scaling's
    state bytes and the trainer read them from it), and the ZeRO stage the trainer runs."""
    from dtrain.parallel.mesh import ParallelDims, zero_stage

    degrees = lambda d: (d.dp, d.dp_replicate, d.dp_shard, [n for n, _ in d.dims()])  # noqa: E731
    assert degrees(ParallelDims.of(8, strategy="zero3")) == (8, 1, 8, ["shard"])
    assert degrees(ParallelDims.of(8, strategy="ddp")) == (8, 8, 1, ["replicate"])
    assert degrees(ParallelDims.of(8, strategy="hsdp", hsdp_replicate=2)) == (
        8,
        2,
        4,
        ["replicate", "shard"],
    )
    assert degrees(ParallelDims.of(8, tp=2, pp=2, strategy="ddp")) == (
        2,
        2,
        1,
        ["pp", "replicate", "tp"],
    )
    assert degrees(ParallelDims.of(8, tp=2, strategy="hsdp", hsdp_replicate=4)) == (
        4,
        4,
        1,
        ["replicate", "tp"],
    )
    assert degrees(ParallelDims.of(1, strategy="single")) == (1, 1, 1, [])
    assert [zero_stage(s, 4) for s in ("single", "ddp", "zero2", "zero3", "hsdp")] == [
        0,
        0,
        2,
        3,
        3,
    ]
    assert (
        zero_stage("zero3", 1) == 0
        and zero_stage("zero3", 2, pp=2) == 2
        and zero_stage("hsdp", 4, pp=2) == 2
    )


def test_memory_need_counts_the_layout_by_hand():
    """dtrain.train.memory_fit for tp2 x pp2 x dp2 (zero3 -> zero2 under pp), one k/v head, fp32,
    worked by hand.

    d=64, F=256, head_dim=16, V=256, T=64, RMSNorm, no bias. Per block per tp rank: norms 2*64,
    wq and wo 64*32 each, w1 and w2 64*128 each, wk and wv whole (1 k/v head < tp) 16*64 each
    = 128 + 4096 + 16384 + 2048 = 22656. Stage 0 = blocks 0-1 + tok/pos embeddings (256+64)*64:
    45312 + 20480 = 65792 (stage 1: 45312 + norm 64 + lm_head 16384 = 61760)."""
    from dtrain.model.gpt import num_params
    from dtrain.train.memory_fit import params_per_rank, training_need

    model = GPTConfig.from_preset("tiny", n_layer=4, n_kv_head=1)
    assert params_per_rank(model) == num_params(model) == 209_472
    assert params_per_rank(model, tp=2, pp=2) == 65_792
    # tp4, one stage: wq, wo 64*16 each, w1, w2 64*64 each, wk, wv still whole; embeddings, norm,
    # lm_head
    assert params_per_rank(model, tp=4) == 4 * (128 + 2048 + 8192 + 2048) + 20480 + 64 + 16384
    train = train_of(tp=2, pp=2, global_batch=8).resolved(
        8, "cpu"
    )  # dp 2, grad_accum 8 / (1 x 2) = 4
    need = training_need(model, train, 8)
    assert need.states == 65_792 * (
        4 + 12 / 2
    )  # zero2 over dp=2: 4 + (4 + 8) / 2 bytes per parameter
    # Activations (Korthikanti, fp32 = 2 x the 16-bit count), per layer per tp rank, s*b*h =
    # 64*1*64, k and v of one head of 4 on each of the 2 ranks (r/tp = 1/4, as r = 2/4 split over
    # 2), no dropout masks (dtrain's GPT has no dropout: ModelShape.dropout False, replicated term
    # 8, not 10):
    # 4096 * (8 + (4 + 4 * 2/4 + 2 * 4 * 2) / 2) * 2 = 155648 bytes. Stage 0 holds min(pp, 4) = 2
    # micro-batches of its 2 layers, 622592, plus their token ids (8 bytes each, / tp): 2 * 8 * 64 /
    # 2 = 512; the last stage 2 layers + the output layer's input and the unfused loss's 14 bytes
    # per logit, / tp:
    # 311296 + (4*64*64 + 14*64*256) / 2 = 434176. The busiest is stage 0; without sequence
    # parallelism Megatron's 5% of temporaries on top.
    assert need.activations == pytest.approx((155_648 * 2 * 2 + 512) * 1.05)
    assert need.init == 4 * 209_472 and need.per_rank == need.states + need.activations
    one = training_need(
        model, train_of(strategy="single", global_batch=None, micro_batch=1).resolved(1, "cpu"), 1
    )
    assert one.states == 16 * 209_472


def test_async_grad_allreduce_without_tp_is_one_line_exit_2(tmp_path):
    from conftest import py

    out = py(
        "-m",
        "fsdp_scaling",
        "world_size=2",
        "model.preset=tiny",
        "train.async_grad_allreduce=true",
        f"results_dir={tmp_path}",
        timeout=120,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and lines == [
        "error: train.async_grad_allreduce=true needs train.tp > 1 (it overlaps "
        "the tensor-parallel input-gradient collective)"
    ], out.stderr
    assert not list(tmp_path.rglob("config.yaml"))
