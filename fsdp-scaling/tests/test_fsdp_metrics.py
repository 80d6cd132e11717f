"""MFU arithmetic, GPU peak lookup and the ZeRO state-bytes formula, by hand."""

import pytest
import torch

from dtrain.costmodel import hardware
from dtrain.model import perf
from dtrain.model.gpt import GPTConfig, flops_per_token
from fsdp_scaling import memory


def test_mfu_hand_case():
    cfg = GPTConfig.from_preset("tiny")  # V=256 T=64 L=2 H=4 d=64, mlp 256
    n_matmul = 2 * (2 * 64 * 64 + 2 * 64 * 64 + 2 * 64 * 256) + 64 * 256  # 114688
    fpt = 6 * n_matmul + 6 * 2 * 4 * (2 * 16) * 64  # 688128 + 98304
    assert flops_per_token(cfg) == fpt == 786432
    # 2 ranks, 1e6 tokens/s overall, peak 1e12 per rank: 786432e6 / 2 / 1e12
    assert perf.mfu(fpt, 1e6, 2, 1e12) == pytest.approx(0.393216)
    assert perf.tflops_per_device(fpt, 1e6, 2) == pytest.approx(0.393216)


def test_gpu_peak_table():
    assert hardware.gpu_profile_name("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert hardware.gpu_profile_name("NVIDIA H100 PCIe") == "h100-pcie"
    assert hardware.gpu_profile_name("NVIDIA H200") == "h200"
    assert hardware.gpu_profile_name("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert hardware.gpu_profile_name("Tesla T4") is None
    assert hardware.datasheet_peak("h100-sxm", "bf16") == pytest.approx(989.4e12)
    assert hardware.datasheet_peak("h100-sxm", "fp8") == pytest.approx(1978.9e12)
    assert hardware.datasheet_peak("a100-80gb", "fp8") is None


def test_cpu_peak_is_measured_and_labelled():
    peak, source = hardware.peak_flops(torch.device("cpu"))
    assert source == "measured cpu matmul probe" and peak > 1e8


def test_zero_formula_by_hand():
    # dim-0 chunks of 10 rows over 4 shards: ceil = 3 -> 3, 3, 3, 1
    assert [memory.local_rows(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert memory.local_rows(2, 4, 3) == 0
    shapes = [(10, 8), (4,)]  # 84 elements, 2 tensors
    assert memory.formula_bytes(shapes, 1, 0) == {
        "params": 336,
        "grads": 336,
        "optimizer": 8 * 84 + 8,
    }
    r3 = memory.formula_bytes(shapes, 4, 3)  # 1 row of 8 + 1 of the vector = 9 elements
    assert r3 == {"params": 36, "grads": 36, "optimizer": 72 + 8}
    assert memory.ideal_bytes(84, 2, 4) == {"params": 84, "grads": 84, "optimizer": 168 + 8}
