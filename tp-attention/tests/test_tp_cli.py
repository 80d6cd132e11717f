"""`python -m tp_attention` end to end on 2 CPU ranks: run dir, records, guide contract, errors."""

from __future__ import annotations

import json

import pytest

from conftest import py
from dtrain.parallel.tp import tp_collectives
from dtrain.results import contract, contract_records, loader

TINY = [
    "train.micro_batch=1",
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_head=4",
    "timing_warmup=1",
    "iters=2",
    "profile.steps=1",
]


def test_tiny_run_writes_the_guide_inputs(tmp_path):
    out = py("-m", "tp_attention", *TINY, f"results_dir={tmp_path}", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    assert run.summary["device"] == "cpu" and run.summary["backend"] == "gloo"
    rows = contract.read(run.summary)  # the typed records calibration reads, one per (tp, SP)
    assert [(r.tp, r.sequence_parallel) for r in rows] == [(2, False), (2, True)]
    for r in rows:
        assert isinstance(r, contract_records.TpMeasurement) and r.where == contract_records.Where(
            "cpu", "gloo"
        )
        assert (r.module, r.micro_batch, r.seq_len, r.d_model, r.n_head, r.n_kv_head) == (
            "block",
            1,
            16,
            32,
            4,
            4,
        )
        assert (
            r.comm_bytes_per_layer
            == tp_collectives.expected_wire_bytes(
                batch=1,
                seq=16,
                d_model=32,
                n_head=4,
                n_kv_head=4,
                tp=2,
                sequence_parallel=r.sequence_parallel,
            )["activation"]
        )
        assert (
            r.comm_bytes_per_layer == 4 * 2 * 16 * 32 * 4 // 2
        )  # 4 all-reduces, 2(n-1)/n of 2 KiB
        assert r.overhead_factor == pytest.approx(r.step_time_s * 2 / r.single_rank_step_time_s)
        assert 0 < r.comm_share < 1 and r.dtensor_step_time_s > 0

    steps = loader.load([tmp_path], kind="step")
    assert set(steps.impl) == {
        "handrolled",
        "handrolled_async",
        "dtensor",
        "single",
        "single_same_threads",
    }
    comm_rows = loader.load([tmp_path], kind="comm")
    assert all(r.analytic == r.counted for r in comm_rows.itertuples())
    assert (run.path / "tp_step_time.png").stat().st_size > 0
    assert "tp_overhead.csv" in {p.name for p in run.path.iterdir()}
    assert "wrote plot" in out.stdout and "hand/DTensor" in out.stdout


def test_kv_heads_below_tp_has_no_dtensor_baseline(tmp_path):
    out = py(
        "-m",
        "tp_attention",
        *TINY,
        "model.n_kv_head=1",
        "train.sequence_parallel=false",
        "impls=[single,handrolled,dtensor]",
        f"results_dir={tmp_path}",
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [row] = contract.read(json.loads(next(tmp_path.rglob("summary.json")).read_text()))
    assert row.dtensor_step_time_s is None and row.n_kv_head == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["model.n_head=6", "model.d_model=48", "world_size=4", "train.tp=4"],
            "n_head=6 is not divisible by tp=4",
        ),
        (["train.tp=4"], "train.tp=4 is larger than world_size=2"),
        (
            ["train.sequence_parallel=true", "model.seq_len=15"],
            "model.seq_len=15 divisible by tp=2",
        ),
        (["seq=16"], "seq was renamed: use model.seq_len"),
        (["tp=2"], "tp was renamed: use train.tp"),  # the trainers' vocabulary (train.*)
        (["micro_batch=2"], "micro_batch was renamed: use train.micro_batch"),
        (["train.precision=float32"], "train.precision='float32' is not one of fp32, bf16"),
    ],
)
def test_bad_input_is_one_line_exit_2_no_run_dir(tmp_path, args, message):
    out = py("-m", "tp_attention", *args, f"results_dir={tmp_path}", timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert not list(tmp_path.rglob("config.yaml"))


def test_parity_bad_tp_is_one_line(tmp_path):
    out = py(
        "-m",
        "tp_attention.parity",
        "world_size=2",
        "train.tp=[1,4]",
        f"results_dir={tmp_path}",
        timeout=60,
    )
    assert out.returncode == 2 and "train.tp=4 is larger than world_size=2" in out.stderr


@pytest.mark.slow
def test_local_multirun_sweep(tmp_path):
    out = py(
        "-m",
        "tp_attention",
        "-m",
        *TINY,
        "train.sequence_parallel=false,true",
        "impls=[single,handrolled]",
        f"results_dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    df = loader.load_runs([tmp_path])
    assert sorted(df["train.sequence_parallel"]) == [False, True]
    assert all("/multirun-" in r for r in df["run"])


@pytest.mark.slurm
@pytest.mark.slow  # tests/test_slurm.py sweeps through submitit_slurm in the fast path
def test_sweep_through_submitit_slurm(tmp_path, slurm_cluster):
    out = py(
        "-m",
        "tp_attention",
        "-m",
        *TINY,
        "train.tp=1,2",
        "train.sequence_parallel=false",
        "impls=[single,handrolled]",
        "world_size=2",
        f"results_dir={tmp_path}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5",
        "hydra.launcher.mem_gb=2",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    df = loader.load_runs([tmp_path])
    assert sorted(df["train.tp"]) == [1, 2]
