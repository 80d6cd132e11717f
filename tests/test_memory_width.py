"""Memory-bound kernels by the width of the rows they walk: kernels.yaml's ``by_width`` shares
are the membound step's measured rates, interpolated in log2(width), and the layer prices each
kind at its own width."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dtrain.costmodel.calibration import Calibration
from dtrain.costmodel.compute import layer_terms
from dtrain.costmodel.device_rates import device_of
from dtrain.costmodel.hardware import Cluster, get_profile
from dtrain.costmodel.kernel_rates import published
from dtrain.costmodel.memory_bound import MEMORY_KIND, memory_bytes, memory_widths
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
MEMBOUND = {
    "h100-sxm": ROOT / "measured/h100-sxm/gpu-check-20261125-105450/runs/membound/output.txt",
    "h200": ROOT / "measured/h200/gpu-check-20261126-021500/runs/membound/output.txt",
}
GPT_125M = ModelShape(12, 768, 12, 12, 50304, 2048, 4.0, False, name="gpt-125m")


def membound_rows(path: Path) -> dict:
    """(op, width of its rows) -> GB/s from a gpu-check membound step's output."""
    data = json.loads(path.read_text().split("\n--- stderr")[0])
    out = {}
    for o in data["ops"]:
        if "d" in o:  # the activations walk rows of 4 x d_model
            wide = o["op"] in ("gelu_fwd_bwd", "swiglu_fwd_bwd")
            out[(o["op"], 4 * o["d"] if wide else o["d"])] = o["GBps"]
    return out


@pytest.mark.parametrize("gpu", sorted(MEMBOUND))
def test_by_width_shares_are_the_membound_rates_over_the_datasheet_bandwidth(gpu):
    rows, km = membound_rows(MEMBOUND[gpu]), published(gpu)
    hbm_gbps = get_profile(gpu).hbm_tbps * 1e3
    ops = {"add": ("residual_add",), "dropout": ("dropout_fwd",), "act_gelu": ("gelu_fwd_bwd",)}
    ops |= {"act_swiglu": ("swiglu_fwd_bwd",), "norm": ("rms_norm_fwd_bwd", "layer_norm_fwd_bwd")}
    for kind, names in ops.items():
        for width, share in km.memory_by_width[kind]:
            measured = sum(rows[(n, int(width))] for n in names) / len(names) / hbm_gbps
            assert share == pytest.approx(measured, abs=6e-4), (kind, width)


def test_share_interpolates_in_log2_width_and_holds_the_ends():
    km = published("h100-sxm")
    norm = dict(km.memory_by_width["norm"])
    assert km.memory_share("norm", 768) == norm[768]
    assert km.memory_share("norm", 512) == norm[768]  # below the narrowest: its share
    assert km.memory_share("norm", 65536) == norm[8192]  # beyond the widest: its share
    f = math.log2(1024 / 768) / math.log2(2048 / 768)  # 1024 between 768 and 2048
    assert km.memory_share("norm", 1024) == pytest.approx(norm[768] + f * (norm[2048] - norm[768]))
    assert km.memory_share("norm") == km.memory["norm"]  # no width: the median share
    assert km.memory_share("softmax", 768) == km.memory["softmax"]  # no by-width entry


def test_each_kind_is_priced_at_the_width_its_rows_have_on_the_rank():
    lay = Layout(tp=2, micro_batch=1, sequence_parallel=True)
    assert memory_widths(GPT_125M, lay) == {
        "norm": 384,
        "add": 384,
        "dropout": 384,
        "act_gelu": 3072 / 2,
    }
    dev = device_of(Cluster.from_profile(get_profile("h100-sxm"), 1, 8), Calibration(), Stack())
    one = Layout(micro_batch=4)
    nbytes, widths = memory_bytes(GPT_125M, one, "bf16", True), memory_widths(GPT_125M, one)
    want = sum(
        b / (dev.hbm_Bps * dev.kernels.memory_share(MEMORY_KIND[k], widths.get(k)))
        for k, b in nbytes.items()
    )
    assert layer_terms(GPT_125M, one, dev).memory == pytest.approx(want, rel=1e-12)
    # the 125M's 768-wide norms stream at the narrow share: slower than the median's
    assert dev.mem_s(1e9, "norm", 768) / dev.mem_s(1e9, "norm") == pytest.approx(
        dev.kernels.memory["norm"] / 0.265
    )
