"""What `dtrain plan`, `dtrain backtest` and `dtrain runs --wide` print fits 100 columns in a pipe
(COLUMNS=100), wrapped by words; and the plan's FLOP rates are ones the kernels can run (issue
40): MFU with its convention named, executed TFLOP/s within the GPU's measured GEMM peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

LONG_CONTEXT = (
    "--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --gated-mlp --seq 131072 --gpus 64".split()
)
README_PLANS = [
    "--params 70e9 --gpus 512 --gpus-per-node 8 --nvlink-gbps 900 --ib-gbps 400".split(),
    (
        "--layers 80 --hidden 8192 --heads 64 --kv-heads 8 --seq 4096 --gpus 256 --gpu a100-80gb"
    ).split(),
    ["--params", "70e9", "--gpus", "64", "--layout", "tp=8 pp=2 zero=1 mb=1"],
    LONG_CONTEXT,
    "--params 8e9 --gpus 8 --kernels eager --attention flash2".split(),
    "--params 70e9 --gpus 256 --seq 8192 --software torchtitan".split(),
    "--params 1e9 --seq 8192 --gpus 8 --software fsdp-eager".split(),
]


def dtrain(*args: str) -> str:
    env = dict(os.environ, COLUMNS="100")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "dtrain"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode in (0, 1, 2), out.stderr
    return out.stdout + out.stderr


def assert_within_100(text: str, what: str) -> None:
    wide = [ln for ln in text.splitlines() if len(ln) > 100]
    assert not wide, f"{what}: {len(wide)} line(s) over 100 columns, e.g. {wide[0]!r}"


@pytest.mark.parametrize("args", README_PLANS, ids=lambda a: " ".join(a)[:40])
def test_readme_plans_fit_100_columns(args):
    assert_within_100(dtrain("plan", *args), "dtrain plan " + " ".join(args))


@pytest.mark.parametrize(
    "args",
    [["backtest"], ["backtest", "--in-sample"], ["backtest", "--measured"], ["runs", "--wide"]],
)
def test_backtest_and_runs_fit_100_columns(args):
    assert_within_100(dtrain(*args), "dtrain " + " ".join(args))


def test_long_context_plan_executes_within_the_measured_gemm_peak():
    text = dtrain("plan", *LONG_CONTEXT)
    assert "MFU convention" in text and "non-causal" in text and "executed" in text
    choice = json.loads(dtrain("plan", *LONG_CONTEXT, "--json"))["choice"]
    assert choice["tflops_per_gpu"] > choice["executed_tflops_per_gpu"]  # causal half at 128K
    assert choice["executed_tflops_per_gpu"] <= choice["gemm_peak_tflops"]
    assert choice["gemm_peak_tflops"] < choice["peak_tflops"]
    assert "non-causal" in choice["flop_convention"]
