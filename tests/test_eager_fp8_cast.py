"""The eager FP8 cast that gpu-check's membound times: torchao's own cast, and the bytes its ops
move (the count behind membound's GB/s and memory_bound.FP8_CAST_BYTES["eager"])."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtrain.gpucheck.eager_bytes import EAGER_FP8_CAST_BYTES, eager_fp8_cast
from dtrain.gpucheck.membound import COLD_OPS, l2_flush, membound

pytest.importorskip("torchao.float8")
SEED = 0
E4M3_MAX = 448.0


class OpBytes(TorchDispatchMode):
    """Bytes each dispatched op reads and writes, over the ops that touch a tensor of ``numel``
    elements (the scale's one-element ops left out)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        if any(a.numel() == self.numel for a in ins + outs):
            moved = sum(a.numel() * a.element_size() for a in ins + outs if a.numel() > 1)
            self.ops.append((func.overloadpacket.__name__, moved))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_cast_is_torchaos_scaled_e4m3_cast(dtype):
    print("seed", SEED)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    got = eager_fp8_cast(x)()
    amax = x.float().abs().max()
    assert float(got._scale) == pytest.approx(E4M3_MAX / float(amax), rel=1e-6)
    want = (x.float() * got._scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(got._data.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_cast_moves_the_bytes_membound_counts(dtype):
    """abs (read, write), max (read), a bf16 input's fp32 upcast, times the scale, clamp, the fp8
    cast: 33 bytes per element from a 32-bit or a 16-bit input."""
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    cast = eager_fp8_cast(x)
    with OpBytes(x.numel()) as rec:
        cast()
    names = [n for n, _ in rec.ops]
    assert names[:2] == ["abs", "max"] and names[-1] == "_to_copy"
    assert sum(b for _, b in rec.ops) == EAGER_FP8_CAST_BYTES * x.numel()


def test_membound_times_both_eager_casts_at_the_counted_bytes():
    got = membound(small=True)
    rows, tokens = {(r["op"], r.get("d")): r for r in got["ops"]}, got["tokens"]
    for op in ("fp8_cast_eager_fp32", "fp8_cast_eager_bf16"):
        row = rows[(op, 64)]
        assert row["bytes"] == EAGER_FP8_CAST_BYTES * tokens * 64
        assert row["GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
    # the byte-wide transposed copy _scaled_mm's column-major operand needs: read 1, write 1
    row = rows[("fp8_transpose", 64)]
    assert row["bytes"] == 2 * tokens * 64
    # COLD_OPS again from a cold L2: the same bytes, their own time
    for op in COLD_OPS:
        warm, cold = rows[(op, 64)], rows[(f"{op}_l2cold", 64)]
        assert cold["bytes"] == warm["bytes"] and cold["seconds"] > 0
        assert cold["GBps"] == pytest.approx(cold["bytes"] / cold["seconds"] / 1e9)
    assert sum(op.endswith("_l2cold") for op, _ in rows) == len(COLD_OPS)
    flush = l2_flush(torch.device("cpu"))
    assert flush.__self__.numel() * 4 == 1 << 20  # off CUDA: 1 MiB (a GPU's: >= 4 x its L2)


def test_eager_cast_share_is_membounds_measured_rate():
    """kernels.yaml's fp8_cast_eager shares are the H100 membound's bf16 cast rate over the
    datasheet HBM bandwidth, width by width, and the median of the widths."""
    import json
    import statistics
    from pathlib import Path

    from dtrain.costmodel.hardware import get_profile
    from dtrain.costmodel.kernel_rates import published

    report = Path(__file__).parents[1] / "measured/h100-sxm/gpu-check-20261127-164510/report.json"
    step = next(s for s in json.loads(report.read_text()) if s["name"] == "membound")
    rates = {r["d"]: r["GBps"] for r in step["data"]["ops"] if r["op"] == "fp8_cast_eager_bf16"}
    assert sorted(rates) == [768, 2048, 4096, 8192]
    hbm_gbps = get_profile("h100-sxm").hbm_tbps * 1e3
    model = published("h100-sxm")
    for d, gbps in rates.items():
        assert model.memory_share("fp8_cast_eager", d) == pytest.approx(gbps / hbm_gbps, abs=1e-3)
    median = statistics.median(gbps / hbm_gbps for gbps in rates.values())
    assert model.memory_share("fp8_cast_eager") == pytest.approx(median, abs=1e-3)


def test_eager_fp8_casts_stream_at_the_eager_cast_rate():
    """Without compile, FP8 adds to a layer's memory-bound time exactly its casts' bytes
    (FP8_CAST_BYTES['eager'] per element, EAGER_FP8_WEIGHT_CAST_BYTES per parameter) at
    fp8_cast_eager's share at d_model; the compiled recipes' casts stream at a residual add's."""
    from dtrain.costmodel.calibration import Calibration
    from dtrain.costmodel.compute import layer_terms
    from dtrain.costmodel.device_rates import device_of
    from dtrain.costmodel.hardware import Cluster, get_profile
    from dtrain.costmodel.measured_cases import eager_stack
    from dtrain.costmodel.memory_bound import EAGER_FP8_WEIGHT_CAST_BYTES, memory_bytes, memory_kind
    from dtrain.costmodel.shapes import Layout, ModelShape

    assert memory_kind("fp8_cast", "eager") == "fp8_cast_eager"
    assert memory_kind("fp8_cast", "dynamic") == memory_kind("fp8_cast", "delayed") == "add"
    shape = ModelShape(4, 4096, 32, 32, 32000, 4096)  # the eager_sweep's 7B/4-layer FP8 case
    lay = Layout(micro_batch=2)
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 1, 8)
    dev = device_of(cluster, Calibration(), eager_stack())
    assert dev.fp8_scaling == "eager"
    fp8 = layer_terms(shape, lay, dev, "fp8").memory
    bf16 = layer_terms(shape, lay, dev, "bf16").memory
    cast = memory_bytes(shape, lay, "fp8", dev.fused, "eager")["fp8_cast"]
    weights = shape.params_per_layer_on_rank(1) * EAGER_FP8_WEIGHT_CAST_BYTES
    share = dev.kernels.memory_share("fp8_cast_eager", 4096)
    assert share == pytest.approx(0.747)
    assert fp8 - bf16 == pytest.approx((cast + weights) / (dev.hbm_Bps * share))
