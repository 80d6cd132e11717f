"""GPU paths (skipped without CUDA): bf16 FSDP2 on NCCL, datasheet peak, CUDA-event timing."""

import json

import pytest

from conftest import py
from dtrain.results import loader


@pytest.mark.gpu
def test_bf16_zero3_on_one_gpu(tmp_path):
    out = py(
        "-m",
        "fsdp_scaling",
        "world_size=1",
        "device=cuda",
        "model.preset=small",
        "train.strategy=zero3",
        "train.precision=bf16",
        "train.steps=8",
        f"results_dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = loader.complete_runs([tmp_path])[0]
    g = run.summary
    assert g["backend"] == "nccl" and g["device"].startswith("cuda")
    assert g["peak_flops_source"].startswith("datasheet: ") and 0 < g["mfu"] < 1
    assert g["mixed_precision"] == "bf16" and g["state_bytes"] == g["state_bytes_formula"]
    assert json.loads((run.path / "env.json").read_text())["world_size"] == 1
