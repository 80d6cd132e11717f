"""CUDA paths (skipped without a GPU): bf16 single-rank TP block vs the plain block, and parity
over NCCL when the host has two GPUs."""

from __future__ import annotations

import pytest
import torch

from conftest import py
from dtrain.model.gpt import Block, GPTConfig
from dtrain.parallel.tp.attention import TensorParallelBlock, TPGroups
from dtrain.results import loader

pytestmark = pytest.mark.gpu


def test_tp1_block_bf16_on_cuda_matches_plain_block():
    cfg = GPTConfig(d_model=256, n_head=8, n_kv_head=2)
    torch.manual_seed(0)
    block = (
        Block(cfg, "blocks.0", lambda n, i, o, b: torch.nn.Linear(i, o, bias=b)).cuda().bfloat16()
    )
    tp_block = TensorParallelBlock.from_full(block, TPGroups(None, 0, 1))
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(tp_block(x), block(x), rtol=2e-2, atol=2e-2)


def test_bench_single_gpu_bf16(tmp_path):
    out = py(
        "-m",
        "tp_attention",
        "device=cuda",
        "world_size=1",
        "train.tp=1",
        "train.precision=bf16",
        "train.sequence_parallel=false",
        f"results_dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = loader.complete_runs([tmp_path])
    assert (
        run.summary["device"] == "cuda"
        and run.summary["backend"] == "nccl"
        and run.summary["gpu_name"]
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_parity_over_nccl(tmp_path):
    out = py(
        "-m",
        "tp_attention.parity",
        "device=cuda",
        "world_size=2",
        "train.tp=[1,2]",
        f"results_dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
