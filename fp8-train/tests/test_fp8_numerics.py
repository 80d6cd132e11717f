"""Formats, scaling, debug statistics and the emulated FP8 Linear, on tensors with known answers."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fp8_train import fp4
from fp8_train.debug import AmaxHistory
from fp8_train.quantstats import per_tensor_stats, roundtrip_stats
from fp8_train.emulated import FP8Linear
from fp8_train.formats import E2M1, E4M3, E5M2, cast, quantize
from fp8_train.scaling import CurrentScaler, DelayedScaler, scale_from_amax


def test_e4m3_saturates_and_e5m2_overflows_to_inf():
    x = torch.tensor([1000.0, -1e6, 448.0, 57344.0, 1e5])
    assert quantize(x, 1.0, E4M3).tolist() == [448.0, -448.0, 448.0, 448.0, 448.0]
    e5 = quantize(x, 1.0, E5M2)
    assert e5[3].item() == 57344.0 and math.isinf(e5[4].item()) and e5[4] > 0
    assert quantize(torch.tensor([1e5]), 1.0, replace(E5M2, saturate=True)).item() == 57344.0
    assert torch.isnan(quantize(torch.tensor([float("nan")]), 1.0, E4M3)).all()


def test_e4m3_rounds_to_nearest_grid_value():
    # 0.1 sits between 0.09375 (1.5 * 2^-4) and 0.1015625 (1.625 * 2^-4); the latter is nearer
    assert quantize(torch.tensor([0.1]), 1.0, E4M3).item() == 0.1015625
    # the scale moves the grid: 0.1 * 64 = 6.4 -> 6.5 (mantissa step 0.5 at 2^2) -> 6.5 / 64
    assert quantize(torch.tensor([0.1]), 64.0, E4M3).item() == pytest.approx(6.5 / 64)


def test_e2m1_grid_and_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.74, 0.3])
    assert cast(x, E2M1).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 0.5]


def test_current_scale_is_max_over_own_amax():
    s = CurrentScaler(E4M3, margin=1)
    assert s.scale_for(torch.tensor([0.5, -4.0])).item() == pytest.approx(448 / 4 / 2)
    assert scale_from_amax(2.0, E5M2).item() == pytest.approx(57344 / 2)


def test_delayed_scale_uses_history_max_and_margin():
    s = DelayedScaler(E4M3, margin=1, history_len=3, algo="max")
    used = [s.scale_for(torch.tensor([a])).item() for a in (1.0, 4.0, 2.0, 0.5)]
    # each cast uses the scale from the amaxes before it: none yet (1), [1], [4,1], [2,4,1]
    assert used == pytest.approx([1.0, 448 / 1 / 2, 448 / 4 / 2, 448 / 4 / 2])
    # after pushing 0.5 the window (len 3) is [0.5, 2, 4]: still max 4; one more small amax drops
    # the 4
    s.scale_for(torch.tensor([0.5]))
    assert s.scale.item() == pytest.approx(448 / 2 / 2)
    recent = DelayedScaler(E4M3, history_len=4, algo="most_recent")
    for a in (8.0, 2.0):
        recent.scale_for(torch.tensor([a]))
    assert recent.scale.item() == pytest.approx(448 / 2)


def test_zero_or_nonfinite_amax_keeps_previous_scale():
    assert scale_from_amax(0.0, E4M3, previous=7.0).item() == 7.0
    assert scale_from_amax(float("inf"), E4M3, previous=7.0).item() == 7.0
    assert scale_from_amax(float("nan"), E4M3, previous=7.0).item() == 7.0


def test_underflow_overflow_mse_cosine_on_crafted_tensor():
    x = torch.tensor([1e-6, 0.5, 500.0, 0.0])  # 1e-6 < E4M3's smallest subnormal 2^-9 / 2
    s = per_tensor_stats(x, 1.0, E4M3)
    assert s["underflows_pct"] == pytest.approx(100 / 3)  # 1 of the 3 non-zero values
    assert s["overflows_pct"] == pytest.approx(25.0)  # 500 > 448, counted before the cast
    deq = torch.tensor([0.0, 0.5, 448.0, 0.0], dtype=torch.float64)
    x64 = x.double()
    assert s["mse"] == pytest.approx(((x64 - deq) ** 2).mean().item())
    assert s["cos_sim"] == pytest.approx((x64 @ deq / (x64.norm() * deq.norm())).item())
    exact = roundtrip_stats(
        torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), E4M3
    )
    assert (
        exact["mse"] == 0.0
        and exact["cos_sim"] == pytest.approx(1.0)
        and exact["underflows_pct"] == 0.0
    )


def test_debug_history_scale_is_as_if_delayed():
    h = AmaxHistory(2)
    assert h.scale(E4M3, 0) == 1.0  # nothing seen yet: TE starts at scale 1
    for a in (2.0, 8.0, 4.0):
        h.push(torch.tensor(a))
    assert h.scale(E4M3, 0) == pytest.approx(448 / 8)  # window of 2: [8, 4]


def test_mx_and_nvfp4_block_round_trips():
    grid = torch.tensor(
        [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0] * 4
    )  # one 32-element block, amax 6
    assert torch.equal(fp4.quantize(grid, "mxfp4"), grid)  # scale 2^(floor(log2 6) - 2) = 1
    assert torch.equal(fp4.quantize(grid * 8, "mxfp4"), grid * 8)  # power-of-two rescale is exact
    assert torch.equal(fp4.quantize(grid[:16], "nvfp4"), grid[:16])
    big = torch.tensor([7.9] + [1.0] * 31)  # amax 7.9 -> scale 1, 7.9 saturates at 6
    q = fp4.block_quantize(big, "mxfp4")
    assert q.dequantized[0].item() == 6.0 and (q.scaled.abs() > 6).sum().item() == 1
    y = torch.randn(4, 64)
    assert (fp4.quantize(y, "mxfp8") - y).abs().max() <= y.abs().max() / 8  # 3 mantissa bits


def test_fp8_linear_matches_hand_computation():
    torch.manual_seed(0)
    layer = FP8Linear(32, 16, bias=True, scaling="current")
    x = torch.randn(4, 32, requires_grad=True)
    y = layer(x)
    sx, sw = 448 / x.abs().max(), 448 / layer.weight.abs().max()
    x8, w8 = quantize(x.detach(), sx, E4M3), quantize(layer.weight.detach(), sw, E4M3)
    assert torch.allclose(y, F.linear(x8, w8, layer.bias), atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    g8 = quantize(g, 57344 / g.abs().max(), E5M2)
    assert torch.allclose(x.grad, g8 @ w8, atol=1e-5)
    assert torch.allclose(layer.weight.grad, g8.t() @ x8, atol=1e-5)
    assert torch.allclose(
        layer.bias.grad, g.sum(0), atol=1e-6
    )  # bias gradient stays high precision
    layer.fp8_enabled = False
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias))


def test_fp8_linear_delayed_state_is_in_the_state_dict():
    layer = FP8Linear(16, 16, bias=False, scaling="delayed", history_len=4)
    layer(torch.ones(2, 16) * 3)
    sd = layer.state_dict()
    assert sd["input_scaler.amax_history"][0].item() == 3.0
    assert sd["input_scaler.scale"].item() == pytest.approx(448 / 3)
    assert set(layer.scales()) == {"input", "weight", "grad_output"}


def test_fp4_linear_runs_and_keeps_no_scale_state():
    layer = FP8Linear(32, 32, bias=False, scaling="nvfp4")
    x = torch.randn(3, 32, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.scales() == {}
