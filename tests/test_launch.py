"""dtrain.run.launch through the selftest app: local, in-job (torchrun), and the error paths."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import py, run_cmd
from dtrain.results import loader


def _only_run(root: Path) -> Path:
    runs = [p.parent for p in root.rglob("config.yaml") if ".hydra" not in p.parts]
    assert len(runs) == 1, runs
    return runs[0]


def test_local_two_ranks_allreduce(tmp_path):
    out = py("-m", "dtrain.run.selftest", "world_size=2", f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    run = _only_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["allreduce_sum"] == 3.0 == summary["expected"]
    assert summary["status"] == "complete" and summary["backend"] == "gloo"
    env = json.loads((run / "env.json").read_text())
    assert env["world_size"] == 2 and env["backend"] == "gloo" and env["torch"] == torch.__version__
    df = loader.load([tmp_path], kind="allreduce_check")
    assert list(df["wrong"]) == [0] and df["world_size"].iloc[0] == 2


def test_local_failing_rank_stops_job_with_traceback(tmp_path):
    t0 = time.monotonic()
    out = py(
        "-m",
        "dtrain.run.selftest",
        "world_size=2",
        "fail_rank=1",
        f"results_dir={tmp_path}",
        timeout=90,
    )
    assert time.monotonic() - t0 < 60
    assert out.returncode == 1
    assert (
        "rank 1 failed" in out.stderr
        and "fails on purpose" in out.stderr
        and "Traceback" in out.stderr
    )
    run = _only_run(tmp_path)
    assert not (run / "summary.json").exists()
    assert loader.find_runs([tmp_path])[0].status == "incomplete"


def test_torchrun_in_job_mode(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = run_cmd(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "dtrain.run.selftest",
            f"results_dir={tmp_path}",
        ],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    run = _only_run(tmp_path)  # both ranks agreed on one run dir
    summary = json.loads((run / "summary.json").read_text())
    assert summary["allreduce_sum"] == 3.0
    assert json.loads((run / "env.json").read_text())["launcher"] == "job"


def test_torchrun_failing_rank(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    t0 = time.monotonic()
    out = run_cmd(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "dtrain.run.selftest",
            "fail_rank=0",
            f"results_dir={tmp_path}",
        ],
        timeout=90,
    )
    assert time.monotonic() - t0 < 60
    assert out.returncode != 0
    assert "fails on purpose" in out.stdout + out.stderr
    assert not list(tmp_path.rglob("summary.json"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("launcher=foo", "launcher='foo' is not one of auto, local, slurm"),
        ("world_size=0", "world_size=0 must be an integer >= 1"),
        ("device=tpu", "device='tpu' must be one of auto, cpu, cuda"),
        ("world_size=1000", "more ranks than this host allows"),
        ("results_dir=/proc/not-here", "is not writable"),
    ],
)
def test_bad_input_one_line_nonzero_no_results(tmp_path, override, message):
    args = ["-m", "dtrain.run.selftest", override] + (
        [] if override.startswith("results_dir") else [f"results_dir={tmp_path}"]
    )
    out = py(*args, timeout=60)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert not list(tmp_path.rglob("config.yaml"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_nccl_without_cuda_is_one_line(tmp_path):
    out = py("-m", "dtrain.run.selftest", "backend=nccl", f"results_dir={tmp_path}", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: backend=nccl needs a CUDA GPU on every rank and an NCCL build of torch: "
        "use backend=gloo (or auto)"
    )


@pytest.mark.gpu
def test_single_gpu_nccl(tmp_path):
    out = py("-m", "dtrain.run.selftest", "world_size=1", "backend=nccl", f"results_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    summary = json.loads((_only_run(tmp_path) / "summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["allreduce_sum"] == 1.0


def test_local_hydra_multirun_one_run_dir_per_point(tmp_path):
    out = py(
        "-m", "dtrain.run.selftest", "-m", "numel=8,16", f"results_dir={tmp_path}", timeout=180
    )
    assert out.returncode == 0, out.stderr
    df = loader.load_runs([tmp_path])
    assert sorted(df["numel"]) == [8, 16] and set(df["summary.allreduce_sum"]) == {3.0}
    assert all("multirun-" in r for r in df["run"])
