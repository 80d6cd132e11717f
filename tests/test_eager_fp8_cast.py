"""The eager FP8 cast that gpu-check's membound times: torchao's own cast, and the bytes its ops
move (the count behind membound's GB/s and memory_bound.FP8_CAST_BYTES["eager"])."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtrain.gpucheck.eager_bytes import EAGER_FP8_CAST_BYTES, eager_fp8_cast
from dtrain.gpucheck.kernels import membound

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
