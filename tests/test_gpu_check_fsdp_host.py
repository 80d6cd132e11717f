"""The FSDP host-work probe (dtrain.gpucheck.fsdp_host) on the CPU, FSDP2 and FSDP1: what it reports
is what its rows give, by its formula (timings are the machine's: only their arithmetic is
checked)."""

import json
import socket
import subprocess
import sys

import pytest

from dtrain.costmodel.eager import kernels_per_step
from dtrain.costmodel.measured_cases import gpt_case_shape
from dtrain.costmodel.shapes import Layout
from dtrain.model.args import GPTConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the fast path probes FSDP2 on 2 ranks; one rank and the autocast baseline are slow (~3 s each)
@pytest.mark.parametrize(
    "fsdp, plain",
    [
        (2, "fp32"),
        pytest.param(1, "fp32", marks=pytest.mark.slow),
        pytest.param(2, "autocast", marks=pytest.mark.slow),
    ],
)
def test_fsdp_host_probe_reports_its_slope_in_launches(monkeypatch, fsdp, plain):
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    probe = [sys.executable, "-m", "dtrain.gpucheck.fsdp_host", "--layers", "1", "3"]
    out = subprocess.run(
        [*probe, "--steps", "2", "--fsdp", str(fsdp)]
        + (["--plain-autocast"] if plain == "autocast" else []),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["fsdp"] == fsdp and data["plain"] == plain
    lo, hi = data["rows"]
    assert (lo["layers"], lo["units"], hi["layers"], hi["units"]) == (1, 2, 3, 4)
    for row in (lo, hi):  # the launches are the cost model's count for the probe's model
        cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=row["layers"], n_head=4, d_model=64)
        shape, structure = gpt_case_shape(cfg)
        assert row["launches"] == kernels_per_step(shape, Layout(), structure=structure)
        assert row["plain_s"] > 0 and row["fsdp_s"] > 0
    per_unit = ((hi["fsdp_s"] - hi["plain_s"]) - (lo["fsdp_s"] - lo["plain_s"])) / 2
    per_launch = (hi["plain_s"] - lo["plain_s"]) / (hi["launches"] - lo["launches"])
    assert data["fsdp_host_s_per_unit"] == pytest.approx(per_unit)
    assert data["plain_host_s_per_launch"] == pytest.approx(per_launch)
    assert data["launch_equivalents"] == pytest.approx(per_unit / per_launch)
