"""HSDP (FSDP2 hybrid sharding, the trainer's train.strategy=hsdp) in the cost model: ZeRO shards
inside each of R replica groups, and the replica groups all-reduce the gradient shards. Memory
and traffic by hand, the `--layout hsdp=` vocabulary, its errors, and the trainer overrides it
becomes."""

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel import Cluster, Layout, ModelShape, memory_per_gpu, params_per_gpu, step_time
from dtrain.costmodel.collectives import (
    all_gather_time,
    allreduce_time,
    group_link,
    reduce_scatter_time,
)
from dtrain.costmodel.links import default_links
from dtrain.costmodel.overrides import train_overrides

SHAPE = ModelShape(32, 4096, 32, 8, 32000, 4096, 3.5, True)
CLUSTER = default_links().apply(Cluster.from_profile("h100-sxm", 32, 8, ib_gbit_per_gpu=100))


def test_hsdp_shards_the_states_inside_a_replica_group():
    psi = params_per_gpu(SHAPE, 1, 1)
    full, hybrid = (
        Layout(dp_shard=32, zero_stage=3),
        Layout(dp_replicate=4, dp_shard=8, zero_stage=3),
    )
    assert hybrid.shard_group == 8 and full.shard_group == 32
    m = memory_per_gpu(SHAPE, hybrid)
    assert (m.params, m.grads, m.optimizer) == pytest.approx(
        (4 * psi / 8, 4 * psi / 8, 8 * psi / 8)
    )
    assert memory_per_gpu(SHAPE, full).optimizer == pytest.approx(8 * psi / 32)


def test_hsdp_traffic_by_hand():
    """Per micro-batch: two bf16 all-gathers and one fp32 reduce-scatter inside the node's 8-rank
    group (NVLink), then an all-reduce of the 1/8 gradient shard over the 4 replica groups, one
    rank per node (one NIC each); plus the per-FSDP-unit latency of the 33 units."""
    psi = params_per_gpu(SHAPE, 1, 1)
    lay = Layout(dp_replicate=4, dp_shard=8, zero_stage=3, grad_accum=2)
    node, across = group_link(CLUSTER, 8, 1), group_link(CLUSTER, 4, 8)
    assert node.beta_Bps == CLUSTER.nvlink.beta_Bps and across.beta_Bps == CLUSTER.ib.beta_Bps
    ag, rs = all_gather_time(2 * psi, 8, node), reduce_scatter_time(4 * psi, 8, node)
    ar = allreduce_time(4 * psi / 8, 4, across)
    lat_ag, lat_rs = (32 * 7 * node.of(c).alpha_s for c in ("all_gather", "reduce_scatter"))
    t = step_time(SHAPE, lay, CLUSTER)
    assert t.dp_comm == pytest.approx(2 * (rs + ar + lat_rs) + 2 * 2 * (ag + lat_ag))


def test_layout_refuses_hsdp_that_cannot_shard():
    # dp = dp_replicate x dp_shard (dtrain.core.layout): replicas that do not divide dp cannot be
    # written down
    assert Layout(dp_replicate=4, dp_shard=8, zero_stage=3).shard_group == 8
    with pytest.raises(ValueError, match="HSDP"):
        Layout(dp_replicate=4, dp_shard=8, zero_stage=1)


BASE = ["plan", "--params", "7e9", "--gpus", "32", "--global-batch", "64", "--ib-gbps", "100"]


def test_plan_layout_hsdp_scores_and_becomes_trainer_overrides(capsys):
    assert main([*BASE, "--layout", "dp=32 hsdp=4 mb=1", "--json"]) == 0
    mine = json.loads(capsys.readouterr().out)["layout"]
    assert (
        mine["hsdp_replicate"] == 4
        and mine["zero_stage"] == 3
        and "zero=3 hsdp=4" in mine["describe"]
    )
    lay = Layout(
        dp_replicate=4, dp_shard=8, zero_stage=3, recompute="none", micro_batch=1, grad_accum=2
    )
    assert mine["step_time_s"]["total"] == pytest.approx(
        step_time(SHAPE.from_params(7e9, seq_len=4096), lay, CLUSTER).total
    )
    overrides, notes = train_overrides(lay, SHAPE, 64)
    assert "train.strategy=hsdp" in overrides and "train.hsdp_replicate=4" in overrides


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            "dp=32 zero=1 hsdp=4",
            "--layout: hsdp=4 shards with FSDP inside each replica group: give zero=3 (or 2), "
            "not zero=1",
        ),
        (
            "dp=32 hsdp=3",
            "--layout: hsdp=3 replica groups do not divide dp = 32: give a divisor of dp",
        ),
    ],
)
def test_plan_layout_hsdp_errors_are_one_line(capsys, layout, message):
    assert main([*BASE, "--layout", layout]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
