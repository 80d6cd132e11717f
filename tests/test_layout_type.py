"""One layout type (issue 38): dtrain.core.layout.Layout is the trainer's, the mesh's and the cost
model's, and the plan -> trainer overrides are the inverse of the trainer's resolution."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from dtrain.core.layout import Layout
from dtrain.costmodel import shapes
import dtrain.costmodel
from dtrain.costmodel.overrides import train_overrides
from dtrain.parallel.mesh import ParallelDims
from dtrain.train.config import TrainConfig

SHAPE = shapes.KNOWN_SHAPES[125e6]


def test_the_cost_model_layout_is_the_one_type():
    assert dtrain.costmodel.Layout is Layout and shapes.Layout is Layout
    assert shapes.RECOMPUTE == ("none", "op", "selective", "full")


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        Layout(8, 2, 1)  # the old positional form is refused
    lay = Layout(dp_shard=8, tp=2, zero_stage=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.tp = 4


def test_expert_parallelism_folds_from_dp_shard_cp_tp():
    lay = Layout(dp_shard=4, tp=2, zero_stage=3, ep=8)
    assert (lay.expert_fold, lay.efsdp, lay.expert_dp) == (8, 1, 1)
    assert Layout(dp_shard=8, zero_stage=1, ep=4).efsdp == 2
    assert Layout(dp_replicate=8, ep=8).expert_fold == 8  # ZeRO 0: folded from DDP's replicas
    with pytest.raises(ValueError) as e:
        Layout(dp_shard=2, zero_stage=3, ep=4)
    assert str(e.value).startswith("ep·etp = 4 must divide the ranks experts fold from")
    with pytest.raises(ValueError):
        Layout(tp=4, dp_shard=2, zero_stage=3, etp=2)  # etp is 1 or tp


def test_derived_values():
    lay = Layout(dp_replicate=2, dp_shard=4, cp=2, tp=2, pp=3, zero_stage=3, pp_virtual=2)
    got = (lay.dp, lay.gpus, lay.world_size, lay.data_shards, lay.shard_group)
    assert got == (8, 96, 96, 16, 8)
    assert (lay.hsdp_replicate, lay.strategy, lay.virtual_stages, lay.trainer_schedule) == (
        2,
        "hsdp",
        2,
        "interleaved_1f1b",
    )


def test_without_zero_the_layout_is_stored_as_ddp():
    """One layout, one value: nothing sharded means every data-parallel rank is a replica."""
    assert Layout(dp_shard=8) == Layout(dp_replicate=8)
    ddp = Layout(dp_shard=8, cp=2)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.hsdp_replicate, ddp.shard_group, ddp.strategy) == (
        8,
        1,
        1,
        16,
        "ddp",
    )


@pytest.mark.parametrize(
    "strategy, dp, replicas, want",
    [
        ("ddp", 8, 1, (8, 1, 0)),
        ("zero2", 8, 1, (1, 8, 2)),
        ("zero3", 8, 1, (1, 8, 3)),
        ("hsdp", 8, 2, (2, 4, 3)),
        ("single", 1, 1, (1, 1, 0)),
        ("zero3", 1, 1, (1, 1, 0)),
    ],
)
def test_from_strategy_is_the_one_split(strategy, dp, replicas, want):
    lay = Layout.from_strategy(strategy, dp=dp, hsdp_replicate=replicas)
    assert (lay.dp_replicate, lay.dp_shard, lay.zero_stage) == want
    dims = ParallelDims.of(dp, strategy=strategy, hsdp_replicate=replicas)
    assert (dims.dp_replicate, dims.dp_shard) == want[:2]
    assert ParallelDims.from_layout(lay) == dims


def test_sharded_strategies_under_pp_run_zero2():
    assert Layout.from_strategy("zero3", dp=4, pp=2).zero_stage == 2
    # FSDP2 shards over the cp ranks
    assert Layout.from_strategy("zero3", dp=1, cp=2).zero_stage == 3


def test_train_config_resolves_to_a_layout():
    train = TrainConfig(
        strategy="hsdp",
        hsdp_replicate=2,
        tp=2,
        pp=2,
        pp_schedule="interleaved_1f1b",
        pp_virtual=2,
        activation_checkpointing="block",
        micro_batch=2,
        global_batch=32,
    )
    assert train.resolved(16).layout(16) == Layout(
        dp_replicate=2,
        dp_shard=2,
        tp=2,
        pp=2,
        zero_stage=2,
        recompute="full",
        micro_batch=2,
        grad_accum=4,
        pp_virtual=2,
    )


def _candidates(rng):
    """Layouts over every axis the trainer has; the invalid ones are dropped by the type itself."""
    axes = dict(
        dp=(1, 2, 4),
        replicas=(1, 2),
        cp=(1, 2),
        tp=(1, 2),
        pp=(1, 2),
        zero=(0, 1, 2, 3),
        recompute=("none", "op", "selective", "full"),
        mb=(1, 2),
        ga=(1, 2, 4),
        sp=(False, True),
        schedule=("1f1b", "gpipe", "zbv"),
        v=(1, 2),
        impl=("ring", "ulysses", "torch"),
    )
    grid = list(itertools.product(*axes.values()))
    for values in rng.sample(grid, 600):
        a = dict(zip(axes, values))
        if a["dp"] % a["replicas"] or (a["pp"] == 1 and (a["schedule"], a["v"]) != ("1f1b", 1)):
            continue
        try:
            yield Layout(
                dp_replicate=a["replicas"],
                dp_shard=a["dp"] // a["replicas"],
                cp=a["cp"],
                tp=a["tp"],
                pp=a["pp"],
                zero_stage=a["zero"],
                recompute=a["recompute"],
                micro_batch=a["mb"],
                grad_accum=a["ga"],
                sequence_parallel=a["sp"],
                pp_schedule=a["schedule"],
                pp_virtual=a["v"],
                cp_impl=a["impl"] if a["cp"] > 1 else "ring",
            )
        except ValueError:
            continue


def _train_config(overrides: list[str]) -> tuple[TrainConfig, int]:
    """The trainer's config from `train.*` overrides, typed as Hydra types them."""
    types = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    values, world = {}, None
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "world_size":
            world = int(value)
        elif key.startswith("train."):
            name = key.removeprefix("train.")
            kind = str(types[name])
            number = int(value) if kind.startswith("int") else value
            values[name] = value == "true" if "bool" in kind else number
    return TrainConfig.from_cfg(values), world


def _runs_as_priced(lay: Layout, notes: list[str]) -> bool:
    """The overrides say what the trainer runs differently in `notes`, and 1f1b with fewer
    micro-batches than stages runs as gpipe; the rest must come back as it went."""
    # the model's notes are not the layout's
    notes = [n for n in notes if not n.startswith(("vocabulary", "the trainer's GPT"))]
    trainer_ok = lay.pp == 1 or (lay.pp_virtual == 1 or lay.grad_accum % lay.pp == 0)
    gpipe = lay.pp_schedule == "1f1b" and lay.grad_accum < lay.pp
    return (
        not notes
        and not gpipe
        and trainer_ok
        and not (lay.zero_stage == 3 and lay.pp > 1)
        and not (lay.cp > 1 and lay.cp_impl == "torch")
    )


def test_overrides_round_trip_through_the_trainer():
    """layout -> train_overrides -> TrainConfig -> TrainConfig.layout == layout, for every layout
    the trainer runs as priced (no notes)."""
    rng = random.Random(random.getrandbits(32))  # the conftest's seeded state (seed printed)
    checked = 0
    for lay in _candidates(rng):
        gb = lay.micro_batch * lay.grad_accum * lay.dp
        overrides, notes = train_overrides(lay, SHAPE, gb)
        if not _runs_as_priced(lay, notes):
            continue
        train, world = _train_config(overrides)
        assert world == lay.gpus
        assert train.resolved(world).layout(world) == lay, (lay, overrides)
        checked += 1
    assert checked >= 20, checked
