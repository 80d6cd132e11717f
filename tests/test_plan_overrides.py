"""`dtrain plan --json` answers with `train_overrides` that fsdp-scaling runs as they are."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import py
from dtrain.costmodel.overrides import train_overrides
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.model.gpt import GPTConfig
from dtrain.results import loader
from dtrain.train import TrainConfig

# a model the CPU trains in seconds (the small preset's vocabulary, so nothing is approximated)
TINY_FLAGS = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "64", "--vocab", "256"]


def as_configs(overrides: list[str]) -> tuple[int, TrainConfig, GPTConfig]:
    kv = dict(o.split("=", 1) for o in overrides)
    train = {k[6:]: v for k, v in kv.items() if k.startswith("train.")}
    ints = ("tp", "pp", "pp_virtual", "micro_batch", "global_batch")
    train = TrainConfig(
        **{
            k: int(v) if k in ints else v == "true" if v in ("true", "false") else v
            for k, v in train.items()
        }
    )
    model = GPTConfig.from_preset(
        kv["model.preset"],
        **{k[6:]: int(v) for k, v in kv.items() if k.startswith("model.") and k != "model.preset"},
    )
    return int(kv["world_size"]), train, model


def test_overrides_of_a_tp_pp_layout_validate_in_the_trainer():
    shape = ModelShape(8, 128, 8, 8, 256, 64)
    layout = Layout(
        dp_shard=2,
        tp=2,
        pp=2,
        zero_stage=1,
        recompute="selective",
        micro_batch=2,
        grad_accum=4,
        sequence_parallel=True,
        pp_virtual=2,
    )
    overrides, notes = train_overrides(layout, shape, global_batch=16)
    assert overrides[:6] == [
        "world_size=8",
        "train.strategy=zero2",
        "train.tp=2",
        "train.pp=2",
        "train.pp_schedule=interleaved_1f1b",
        "train.pp_virtual=2",
    ]
    assert "train.activation_checkpointing=block" in overrides and "model.n_layer=8" in overrides
    assert "train.sequence_parallel=true" in overrides and any("ZeRO-1" in n for n in notes)
    # under pp the trainer's zero2 reduces after the last backward (torch.distributed.pipelining):
    # said, not hidden
    assert any(
        n.startswith(
            "under pp the trainer's zero2 reduces its gradients after the stage's last backward"
        )
        for n in notes
    )
    _, no_pp = train_overrides(replace(layout, pp=1, tp=4, pp_virtual=1), shape, global_batch=16)
    assert not any(n.startswith("under pp") for n in no_pp)
    world, train, model = as_configs(overrides)
    run = train.resolved(world, "cpu")
    run.validate_model(model)
    assert run.grad_accum == layout.grad_accum  # 16 / (micro_batch 2 x dp 2)
    # fewer micro-batches than stages: gpipe (1f1b would refuse)
    few, _ = train_overrides(Layout(pp=4, micro_batch=8, grad_accum=1), shape, global_batch=8)
    assert "train.pp_schedule=gpipe" in few
    world, train, model = as_configs(few)
    train.resolved(world, "cpu").validate_model(model)


@pytest.mark.slow  # a 4-rank fsdp-scaling run in a subprocess: ~60-90 s on 2 busy cores
def test_plan_json_for_a_four_gpu_cluster_runs_in_fsdp_scaling(tmp_path):
    out = py(
        "-m",
        "dtrain.cli.main",
        "plan",
        *TINY_FLAGS,
        "--gpus",
        "4",
        "--gpus-per-node",
        "4",
        "--global-batch",
        "8",
        "--json",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout)
    overrides = answer["train_overrides"]
    c = answer["choice"]
    assert (
        f"world_size={c['dp'] * c['tp'] * c['pp']}" in overrides
        and f"train.tp={c['tp']}" in overrides
    )
    assert f"train.pp={c['pp']}" in overrides
    print("plan:", c["describe"], "->", " ".join(overrides))
    run = py(
        "-m",
        "fsdp_scaling",
        *overrides,
        "train.steps=2",
        "train.timing_warmup=0",
        "profile.enabled=false",
        "train.dataset_tokens=20000",
        f"results_dir={tmp_path}",
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [done] = loader.complete_runs([tmp_path])
    s = done.summary
    assert (s["world_size"], s["tp"], s["pp"], s["dp"]) == (4, c["tp"], c["pp"], c["dp"])
    assert s["global_batch"] == 8 and s["final_loss"] > 0


def test_overrides_of_an_hsdp_layout_validate_in_the_trainer():
    """hsdp=R in a plan is the trainer's train.strategy=hsdp with R replica groups: the same
    mesh."""
    shape = ModelShape(8, 128, 8, 8, 256, 64)
    layout = Layout(dp_replicate=2, dp_shard=4, zero_stage=3, micro_batch=1, grad_accum=2)
    overrides, _ = train_overrides(layout, shape, global_batch=16)
    assert "train.strategy=hsdp" in overrides and "train.hsdp_replicate=2" in overrides
    kv = dict(o.split("=", 1) for o in overrides)
    world, train, model = as_configs(
        [o for o in overrides if not o.startswith("train.hsdp_replicate")]
    )

    run = replace(train, hsdp_replicate=int(kv["train.hsdp_replicate"])).resolved(world, "cpu")
    run.validate_model(model)
    from dtrain.parallel.mesh import ParallelDims

    dims = ParallelDims.of(world, strategy="hsdp", hsdp_replicate=run.hsdp_replicate)
    assert (dims.dp_replicate, dims.dp) == (2, 8) and run.grad_accum == layout.grad_accum
