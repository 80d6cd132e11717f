"""The debug tool's batched statistics against a straightforward per-tensor, per-recipe reference
(formats.quantize round trip, float64 math, plain comparisons) on crafted tensors."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from fp8_train.conf import Fp8DebugConfig, LayerSelection
from fp8_train.debug import DebugTool
from fp8_train.quantstats import per_tensor_stats
from fp8_train.formats import E4M3, quantize
from fp8_train.scaling import scale_from_amax


def reference(x: torch.Tensor, scale: float, fmt, sample=None) -> dict:
    xf = x.reshape(-1).float()
    part = xf if sample is None else xf[sample]
    deq = quantize(part, scale, fmt)
    x64, d64 = part.double(), deq.double()
    nonzero = part != 0
    err, power, dpower = (
        ((x64 - d64) ** 2).sum().item(),
        (x64**2).sum().item(),
        (d64**2).sum().item(),
    )
    norms = math.sqrt(power * dpower)
    return {
        "scale": scale,
        "underflows_pct": 100 * (nonzero & (deq == 0)).sum().item() / max(1, nonzero.sum().item()),
        "overflows_pct": 100 * (xf.abs() > fmt.max / scale).sum().item() / max(1, xf.numel()),
        "mse": err / max(1, part.numel()),
        "rel_mse": err / power if power > 0 else 0.0,
        "cos_sim": (x64 @ d64).item() / norms if norms > 0 else (1.0 if err == 0 else 0.0),
    }


class Records:
    def __init__(self):
        self.rows = []

    def record(self, kind, **values):
        self.rows.append(values)


def crafted(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    edge = torch.tensor(
        [0.0, 1e-6, -1e-6, 2.0**-10, 2.0**-10 * 3, 0.5, 500.0, -448.0, 448.0, 1e4, -0.0]
    )
    thr = torch.tensor(
        448 / float(scale_from_amax(3.0, E4M3)), dtype=torch.float32
    )  # |x| == max / scale
    return {
        "edge": torch.cat([edge, torch.randn(3000, generator=g)]),
        "ties": torch.cat(
            [
                thr.reshape(1),
                torch.nextafter(thr, torch.tensor(9.0)).reshape(1),
                torch.full((50,), 3.0),
            ]
        ),
        "big": torch.randn(64, 80, generator=g)
        * torch.logspace(-8, 2, 80),  # > sample_elements: sampled
        "grad": torch.randn(2500, generator=g) * 1e-3
        + torch.where(torch.arange(2500) % 97 == 0, 8e4, 0.0),
        "zeros": torch.zeros(64),
        "empty": torch.zeros(0),
    }


def debug_cfg(**kw):
    """The `fp8_debug:` node: its dataclass's defaults, every layer selected, and `kw`."""
    base = dict(
        margin=0, e5m2_overflow="saturate", layers=LayerSelection(".*")
    )  # fp8.* interpolations, standalone
    return OmegaConf.structured(Fp8DebugConfig(**{**base, **kw}))


@pytest.mark.parametrize("margin,e5m2", [(0, "saturate"), (1, "inf")])
def test_batched_debug_stats_match_the_per_tensor_reference(margin, e5m2):
    cfg = debug_cfg(
        freq=2,
        margin=margin,
        amax_history_len=3,
        e5m2_overflow=e5m2,
        recipes=["current", "delayed"],
        sample_elements=4000,
    )
    tool, out = DebugTool(cfg, "/nonexistent", 0), Records()
    tool._writer = out
    kinds = {
        "edge": "activation",
        "ties": "weight",
        "big": "activation",
        "grad": "gradient",
        "zeros": "weight",
        "empty": "gradient",
    }
    history: dict[str, list[float]] = {}
    for step, seed in (
        (1, 0),
        (2, 1),
    ):  # step 1 only tracks amaxes (the delayed history), step 2 samples
        tool.step = step
        for name, x in crafted(seed).items():
            x = x / 4 if step == 1 else x  # the history lags: delayed scales overflow on step 2
            tool.observe(name, kinds[name], x)
            if step == 1:
                history[name] = [x.abs().max().item() if x.numel() else 0.0]
        tool.flush()
    rows = {(r["layer"], r["recipe"]): r for r in out.rows}
    assert len(rows) == len(out.rows) == 2 * len(kinds)
    for name, x in crafted(1).items():
        fmt = tool.formats[kinds[name]]
        amax = x.abs().max().item() if x.numel() else 0.0
        sample = tool.sample_of(x.reshape(-1))
        scales = {
            "current": float(scale_from_amax(amax, fmt, margin)),
            "delayed": float(scale_from_amax(max(history[name]), fmt, margin)),
        }
        for recipe, scale in scales.items():
            got, want = rows[name, recipe], reference(x, scale, fmt, sample)
            assert (
                got["cur_amax"] == amax
                and got["numel"] == x.numel()
                and got["sampled"] == (sample is not None)
            )
            assert got["format"] == fmt.name and got["step"] == 2 and got["tensor"] == kinds[name]
            for k in ("scale", "underflows_pct", "overflows_pct"):
                assert got[k] == want[k], (name, recipe, k)
            for k in ("mse", "rel_mse", "cos_sim"):
                assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-15, nan_ok=True), (
                    name,
                    recipe,
                    k,
                )
    assert (
        rows["edge", "current"]["underflows_pct"] > 0
        and rows["grad", "delayed"]["overflows_pct"] > 0
    )


def test_per_tensor_stats_counts_nan_as_neither_underflow_nor_overflow():
    x = torch.tensor([float("nan"), 1e-6, 0.0, 500.0, float("inf"), -float("inf"), 2.0])
    got, want = per_tensor_stats(x, 1.0, E4M3), reference(x, 1.0, E4M3)
    for k in ("underflows_pct", "overflows_pct"):
        assert got[k] == want[k]
    assert math.isnan(got["mse"]) and math.isnan(want["mse"])


def test_hooks_do_nothing_on_steps_that_are_not_sampled_for_layers_with_their_own_scales():
    cfg = debug_cfg(freq=10, amax_history_len=4, recipes=["delayed", "current"], sample_elements=0)
    tool = DebugTool(cfg, "/nonexistent", 0)
    layer = torch.nn.Linear(4, 4)
    tool.own_scalers["l"] = layer
    layer.register_forward_hook(tool._forward_hook("l"))
    tool.step = 3
    x = torch.randn(2, 4, requires_grad=True)
    out = layer(x)
    assert not out._backward_hooks and not tool.pending and not tool.histories


def test_a_recomputed_forward_is_not_observed_twice():
    """Activation checkpointing runs a block's forward again inside backward; the tool has seen
    it."""
    from torch.utils.checkpoint import checkpoint

    cfg = debug_cfg(freq=1, amax_history_len=4, recipes=["delayed"], sample_elements=0)
    tool = DebugTool(cfg, "/nonexistent", 0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_hook(tool._forward_hook("l"))
    tool.step = 1
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint(lambda t: layer(t).relu(), x, use_reentrant=False).sum().backward()
    assert sorted(p.tensor for p in tool.pending) == ["activation", "gradient", "weight"]
