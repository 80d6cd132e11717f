"""Two Slurm nodes on one machine (`scripts/slurm-cluster start --nodes 2`: each node its own
network + UTS namespace, hostname and slurmd): ranks on separate hosts, MASTER_ADDR from the node
list, inter-node link class, HSDP's shard groups inside a node. And `dtrain runs` on a sweep with
a failing point. Skipped without such a cluster."""

from __future__ import annotations

import pytest

from conftest import py
from dtrain.results import loader

pytestmark = pytest.mark.slurm

ON_TWO_NODES = ["launcher=slurm", "slurm.nodes=2", "slurm.partition=debug", "slurm.time_min=5"]


@pytest.mark.slow  # the fast path launches on two nodes in test_allreduce_bench_measures_inter_node
def test_selftest_across_two_nodes(tmp_path, slurm_two_nodes):
    out = py(
        "-m",
        "dtrain.run.selftest",
        *ON_TWO_NODES,
        "world_size=2",
        f"results_dir={tmp_path}",
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    assert run.summary["allreduce_sum"] == 3.0
    assert run.env["num_nodes"] == 2 and len(set(run.env["rank_hosts"])) == 2
    assert run.env["slurm_nodelist"] and run.env["slurm_job"]


def test_allreduce_bench_measures_inter_node(tmp_path, slurm_two_nodes):
    out = py(
        "-m",
        "allreduce_bench",
        *ON_TWO_NODES,
        "world_size=2",
        "collectives=[all_reduce]",
        "max_bytes=16K",
        "iters=3",
        f"results_dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    records = loader.load([tmp_path], kind="collective")
    assert "inter_node" in set(records["link_class"])
    assert (records["wrong"] == 0).all()
    [run] = loader.complete_runs([tmp_path])
    assert run.summary["num_hosts"] == 2


@pytest.mark.slow
def test_hsdp_shards_inside_a_node_replicates_across(tmp_path, slurm_two_nodes):
    out = py(
        "-m",
        "fsdp_scaling",
        *ON_TWO_NODES,
        "world_size=4",
        "train.strategy=hsdp",
        "train.hsdp_replicate=2",
        "model.preset=tiny",
        "train.steps=3",
        "train.timing_warmup=1",
        "profile.enabled=false",
        f"results_dir={tmp_path}",
        timeout=400,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    hosts = run.env["rank_hosts"]
    assert len(set(hosts)) == 2
    # mesh (replicate=2, shard=2): shard groups are ranks {0,1} and {2,3}, replicas pair 0-2 and 1-3
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    state = loader.load([tmp_path], kind="state_bytes")
    assert set(state["shards"]) == {2}


@pytest.mark.slow  # ~7 s; fast: test_hardening_values' local sweep with a failing point
def test_sweep_with_one_failing_point_runs_the_others_and_lists_it(tmp_path, slurm_cluster):
    """A point that fails at run time (an invalid point is refused before any point runs,
    dtrain.run.precheck):
    the other point completes, and `dtrain runs` names the failed one with its job id and error."""
    out = py(
        "-m",
        "dtrain.run.selftest",
        "-m",
        "fail_rank=null,1",
        "world_size=2",
        f"results_dir={tmp_path}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5",
        "hydra.launcher.mem_gb=2",
        timeout=300,
    )
    assert out.returncode != 0  # the multirun reports the failed point
    # with the root cause (rank 1's own error), not task 0's "connection closed" that submitit
    # returns first
    assert "rank 1 failed first: RuntimeError: selftest: rank 1 fails on purpose" in out.stderr, (
        out.stderr[-3000:]
    )
    [run] = loader.complete_runs([tmp_path], warn=False)
    assert run.summary["allreduce_sum"] == 3.0 and run.path.name == "0"
    listed = py("-m", "dtrain.cli.main", "runs", str(tmp_path), timeout=60)
    assert listed.returncode == 0, listed.stderr
    table, bad = listed.stdout.split("1 Slurm job(s) without a complete run:")
    assert run.env["slurm_job"] in table  # the good point: its job id, state, nodes and logs
    job = run.env["slurm_job"].split("_")[0] + "_1"
    assert f"job {job}" in bad and f"(sweep point {run.path.parent.relative_to(tmp_path)}/1)" in bad
    assert "RuntimeError: selftest: rank 1 fails on purpose (fail_rank=1)" in bad
