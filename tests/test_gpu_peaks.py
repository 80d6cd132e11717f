"""GPU peak lookup by real `torch.cuda.get_device_name` strings, TF32 for fp32 runs, and the
one-line error for a GPU that hardware.yaml does not know (CUDA faked: names are all the lookup
needs)."""

from __future__ import annotations

import pytest
import torch

from dtrain.core.errors import UserError
from dtrain.costmodel import hardware
from dtrain.model import perf

# name as torch.cuda.get_device_name / nvidia-smi print it -> profile, dense bf16 and fp8 TFLOP/s
REAL_NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.4, 1978.9),
    ("NVIDIA H100 PCIe", "h100-pcie", 756.5, 1513),
    ("NVIDIA H100 NVL", "h100-nvl", 835.5, 1670.5),
    ("NVIDIA H200", "h200", 989.4, 1978.9),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312, None),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb", 312, None),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312, None),
    ("NVIDIA A100 80GB PCIe", "a100-80gb", 312, None),
    ("NVIDIA B200", "b200", 2250, 4500),
]


@pytest.mark.parametrize("name, profile, bf16, fp8", REAL_NAMES)
def test_real_device_names_map_to_exact_profiles(name, profile, bf16, fp8):
    assert hardware.gpu_profile_name(name) == profile
    assert hardware.datasheet_peak(profile, "bf16") == pytest.approx(bf16 * 1e12)
    assert hardware.datasheet_peak(profile, "tf32") == pytest.approx(bf16 / 2 * 1e12)
    assert hardware.datasheet_peak(profile, "fp8") == (
        None if fp8 is None else pytest.approx(fp8 * 1e12)
    )
    assert (
        hardware.datasheet_peak(profile, "fp32") is None
    )  # CUDA-core fp32: no figure, TF32 is turned on instead


@pytest.mark.parametrize(
    "name", ["NVIDIA H200 NVL", "NVIDIA GH200 480GB", "Tesla T4", "NVIDIA H100", "NVIDIA L40S"]
)
def test_names_that_are_not_exact_are_not_guessed(name):
    assert hardware.gpu_profile_name(name) is None


def fake_gpu(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


@pytest.fixture
def tf32_restored():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_unknown_gpu_is_one_line_naming_hardware_yaml(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200 NVL")
    with pytest.raises(UserError) as e:
        hardware.peak_flops(torch.device("cuda", 0), "bf16")
    assert "\n" not in str(e.value) and "'NVIDIA H200 NVL'" in str(e.value)
    assert "dtrain/costmodel/hardware.yaml" in str(e.value)


def test_fp32_on_a_gpu_uses_the_tf32_peak_once_tf32_is_on(monkeypatch, tf32_restored):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    torch.backends.cuda.matmul.allow_tf32 = False
    with pytest.raises(UserError, match="h100-sxm has no fp32 tensor-core peak .*turn TF32 on"):
        hardware.peak_flops(torch.device("cuda", 0), "fp32")
    assert (
        perf.enable_tf32(torch.device("cpu")) is False
        and torch.backends.cuda.matmul.allow_tf32 is False
    )
    assert perf.enable_tf32(torch.device("cuda", 0)) is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert hardware.peak_flops(torch.device("cuda", 0), "fp32") == (
        pytest.approx(494.7e12),
        "datasheet: h100-sxm tf32",
    )
    assert hardware.peak_flops(torch.device("cuda", 0), "bf16") == (
        pytest.approx(989.4e12),
        "datasheet: h100-sxm bf16",
    )
    assert hardware.peak_flops(torch.device("cuda", 0), "fp8") == (
        pytest.approx(1978.9e12),
        "datasheet: h100-sxm fp8",
    )
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match="a100-80gb has no fp8 tensor-core peak"):
        hardware.peak_flops(torch.device("cuda", 0), "fp8")
