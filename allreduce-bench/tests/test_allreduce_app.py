"""`python -m allreduce_bench` end to end: 2 gloo ranks, every collective, every output file."""

import dataclasses
import json
import math

import pandas as pd
import pytest

from allreduce_bench import busbw
from allreduce_bench.bench import GUIDE_FIT_KEYS
from conftest import py
from dtrain.results import contract, contract_records, loader

SMALL = ["min_bytes=1K", "max_bytes=64K", "step_factor=8", "iters=3", "timing_warmup=1"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ar")
    out = py("-m", "allreduce_bench", f"results_dir={out_dir}", *SMALL, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([out_dir])
    return out, run


def test_prints_nccl_tests_table_and_paths(full_run):
    out, run = full_run
    assert "#     size      count     type redop root    time  algbw  busbw #wrong" in out.stdout
    # within 100 columns (issue 40), but for the lines naming the run's (pytest's long) path
    assert max(len(ln) for ln in out.stdout.splitlines() if str(run.path) not in ln) <= 100
    for c in busbw.COLLECTIVES:
        assert f"# {c}  link_class=intra_node  2 ranks/group" in out.stdout
    assert f"wrote plot {run.path / 'busbw_vs_size.png'}" in out.stdout
    assert f"wrote table {run.path / 'collectives.csv'}" in out.stdout
    assert "α–β fit" in out.stdout


def test_records_csv_and_correctness(full_run):
    _, run = full_run
    df = loader.load([run.path], kind="collective")
    # 3 sizes x (all_gather, reduce_scatter in both modes + 6 collectives in one mode)
    assert len(df) == 3 * (2 * 2 + 6)
    assert set(df.collective) == set(busbw.COLLECTIVES)
    assert (
        df.wrong == 0
    ).all()  # torch's results equal the independently computed ones, in both modes
    assert set(df[df.collective == "all_gather"]["mode"]) == {"in_place", "out_of_place"}
    for r in df.to_dict("records"):
        assert r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"] * busbw.bus_factor(r["collective"], 2)
        )
        assert r["algbw_GBps"] == pytest.approx(r["nbytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
    assert sorted(set(df.nbytes)) == [1024, 8192, 65536]
    csv = pd.read_csv(run.path / "collectives.csv")
    assert len(csv) == len(df) and set(csv.columns) >= {
        "time_us",
        "time_min_us",
        "time_max_us",
        "busbw_GBps",
    }


def test_summary_guide_inputs_contract(full_run):
    _, run = full_run
    fits = contract.read(
        run.summary
    )  # the typed records calibration reads: one per intra/inter-node fit
    assert fits and all(isinstance(f, contract_records.CollectiveFit) for f in fits)
    assert {f.where for f in fits} == {contract_records.Where("cpu", "gloo", None)}
    # every collective is fitted, or listed with the reason (3 noisy CPU sizes may not define a
    # line)
    unfitted = {u["collective"] for u in run.summary["unfitted"]}
    assert {f.collective for f in fits} | unfitted == set(busbw.COLLECTIVES)
    assert all(u["reason"] for u in run.summary["unfitted"])
    for f in fits:
        assert {k: v for k, v in dataclasses.asdict(f).items() if k != "where"} == {
            k: v
            for k, v in next(
                s for s in run.summary["fits"] if s["collective"] == f.collective
            ).items()
            if k in GUIDE_FIT_KEYS
        }
        assert f.link_class == "intra_node" and f.dtype == "float32" and f.world_size == 2
        assert f.algo_factor == busbw.bus_factor(f.collective, 2) and f.n_points == 3
        assert f.alpha_us >= 0 and f.beta_GBps > 0 and math.isfinite(f.r2)
        assert (
            f.theoretical_GBps is None and f.beta_pct_of_theoretical is None
        )  # CPU: no datasheet link
    assert set(run.summary["peak_busbw_GBps"]) == set(busbw.COLLECTIVES)
    assert (run.summary["device"], run.summary["backend"]) == (
        "cpu",
        "gloo",
    ) and "guide" not in run.summary
    assert run.summary["link_classes_not_measured"]["inter_node"] == "all ranks ran on one host"


def test_topology_report_and_env(full_run):
    _, run = full_run
    assert "No NVIDIA GPU" in (run.path / "TOPOLOGY.md").read_text()
    env = json.loads((run.path / "env.json").read_text())
    assert env["topology"] == {
        "gpus_per_node": 0,
        "nodes": 1,
    }  # the launcher's env.json, never rewritten
    assert (
        run.summary["topology"]["source"] == "none"
        and run.summary["topology"]["host_cpu"]["logical_cpus"] >= 1
    )
    assert env["backend"] == "gloo" and (run.path / "alpha_beta_fit.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["collectives=[all_reduce,allreduce]"],
            "error: collectives='allreduce' must be one of all_reduce, ",
        ),
        (["min_bytes=4M", "max_bytes=1K"], "error: min_bytes=4M is larger than max_bytes=1K"),
        (["dtypes=[float8_e4m3fn]"], "error: backend=gloo cannot move float8_e4m3fn tensors"),
        (["dtypes=[int32]", "redop=avg"], "error: backend=gloo cannot reduce int32 with redop=avg"),
    ],
)
def test_bad_input_one_line_exit_2_no_run_dir(tmp_path, args, message):
    out = py("-m", "allreduce_bench", f"results_dir={tmp_path}", *args, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr
    assert not list(tmp_path.rglob("summary.json")) and not list(tmp_path.rglob("config.yaml"))


def test_corrupted_result_fails_the_run_after_writing_records(tmp_path):
    out = py(
        "-m",
        "allreduce_bench",
        f"results_dir={tmp_path}",
        "collectives=[all_reduce,all_gather]",
        "debug.inject_wrong=all_gather",
        *SMALL,
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        "correctness check failed in 6 case(s): all_gather intra_node float32 1024 B "
        "out_of_place: 1 wrong" in out.stderr
    )
    [run] = loader.find_runs([tmp_path])
    assert run.status == "incomplete"  # no summary.json: loaders skip it
    rows = [json.loads(line) for line in (run.path / "records.jsonl").read_text().splitlines()]
    assert {
        r["collective"]: r["wrong"] for r in rows if r["nbytes"] == 1024 and r["mode"] == "in_place"
    } == {"all_reduce": 0, "all_gather": 1}


# 4 ranks; tests/test_slurm_multinode.py measures a real inter-node link when a cluster is up
@pytest.mark.slow
def test_simulated_two_nodes_measure_intra_inter_and_world(tmp_path):
    out = py(
        "-m",
        "allreduce_bench",
        f"results_dir={tmp_path}",
        "world_size=4",
        "debug.simulate_nodes=2",
        "collectives=[all_reduce,sendrecv,broadcast]",
        "modes=[in_place,out_of_place]",
        *SMALL,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    df = loader.load([run.path], kind="collective")
    shape = {
        lc: (int(g.group_size.iloc[0]), int(g.groups.iloc[0])) for lc, g in df.groupby("link_class")
    }
    assert shape == {"intra_node": (2, 2), "inter_node": (2, 2), "world": (4, 1)}
    assert (df.wrong == 0).all()
    fitted = {(f["collective"], f["link_class"]) for f in run.summary["fits"]}
    unfitted = {(u["collective"], u["link_class"]) for u in run.summary["unfitted"]}
    assert fitted | unfitted == {
        (c, lc)
        for c in ("all_reduce", "sendrecv", "broadcast")
        for lc in ("intra_node", "inter_node", "world")
    }
    assert {f.link_class for f in contract.read(run.summary)} <= {"intra_node", "inter_node"}
    assert {
        (r["link_class"], r["bus_factor"])
        for r in df[df.collective == "all_reduce"].to_dict("records")
    } == {("intra_node", 1.0), ("inter_node", 1.0), ("world", 1.5)}


@pytest.mark.gpu
def test_single_rank_nccl_path(tmp_path):
    out = py(
        "-m",
        "allreduce_bench",
        f"results_dir={tmp_path}",
        "world_size=1",
        "device=cuda",
        "collectives=[all_reduce,all_gather,broadcast]",
        "dtypes=[bf16]",
        "min_bytes=1M",
        "max_bytes=64M",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    assert (run.summary["device"], run.summary["backend"]) == ("cuda", "nccl")
    assert (loader.load([run.path], kind="collective").wrong == 0).all()
    assert "## Links per GPU pair" in (run.path / "TOPOLOGY.md").read_text()


@pytest.mark.slurm
def test_sweep_through_submitit_slurm(tmp_path, slurm_cluster):
    out = py(
        "-m",
        "allreduce_bench",
        "-m",
        "dtypes=[float32],[bfloat16]",
        "collectives=[all_reduce]",
        f"results_dir={tmp_path}",
        *SMALL,
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5",
        "hydra.launcher.mem_gb=2",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    runs = loader.load_runs([tmp_path])
    assert len(runs) == 2 and set(runs["summary.backend"]) == {"gloo"}
    # one run per sweep point, each measuring its own dtype with no wrong element (whether 3 small
    # sizes under load give a fit is noise, so the fit itself is checked elsewhere)
    records = loader.load([tmp_path], kind="collective")
    assert sorted(records.groupby("run")["dtype"].agg(lambda d: ",".join(sorted(set(d))))) == [
        "bfloat16",
        "float32",
    ]
    assert (records["wrong"] == 0).all()
