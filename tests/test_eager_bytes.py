"""The eager step's memory-bound bytes counted from the ops PyTorch dispatches
(``dtrain.gpucheck.eager_bytes``): under autocast and in FSDP2's bf16 parameters, against hand
counts, EAGER_BYTES and BF16_PARAMS_BYTES, and the step the cost model prices from them."""

from __future__ import annotations

import math

import pytest

from dtrain.costmodel.calibration import Calibration
from dtrain.costmodel.compute import layer_terms
from dtrain.costmodel.device_rates import device_of
from dtrain.costmodel.hardware import Cluster
from dtrain.costmodel.memory_bound import BF16_PARAMS_BYTES, EAGER_BYTES, memory_bytes
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.stack import Stack
from dtrain.costmodel.timemodel import step_time
from dtrain.gpucheck.eager_bytes import per_token_layer

# per token and layer, x d_model: GELU at 4d reads and writes 2 + 2 forward, 2 + 2 + 2 backward
GELU = 4 * (4 + 6)
BIAS_SUMS = 2 * (3 + 1 + 4 + 1)  # the bias gradients' sums over the tokens: q, k, v, o, fc1, fc2


def hand_count(autocast: bool, bias: bool) -> float:
    """Bytes per token and layer of dtrain's GPT block, forward and backward, in units of d."""
    if autocast:  # fp32 residual stream and norms, bf16 linears
        casts = 6 * (4 + 4 + 2)  # 4 linear inputs to bf16, their gradients back, 2 branch grads
        adds = 2 * (4 + 2 + 4) + 4 * 12  # residual adds fp32 + bf16; backward fp32 sums
        norms = 2 * 8 + 2 * 12  # LayerNorm forward read/write, backward x, dy, dx
    else:  # all bf16
        casts, adds, norms = 0, 6 * 6, 2 * 4 + 2 * 6
    return casts + adds + GELU + norms + (BIAS_SUMS if bias else 0)


@pytest.mark.parametrize("preset, bias", [("125m", True), ("1b", False)])
def test_dispatched_bytes_are_the_hand_count(preset, bias):
    for mode in ("autocast", "bf16"):
        got = per_token_layer(preset, 256, mode)["bytes_per_d"]
        assert got == pytest.approx(hand_count(mode == "autocast", bias), abs=0.2), mode


def test_eager_and_bf16_factors_are_the_counts():
    """The autocast count is 2.48-2.69x the fused count (84 d: norms 20, adds 24, GELU 40), the
    GPU's measured EAGER_BYTES 2.5 between; BF16_PARAMS_BYTES is the two presets' ratios'
    geometric mean."""
    fused = 20 + 24 + 10 * 4
    ratios = []
    for bias in (True, False):
        autocast, bf16 = hand_count(True, bias), hand_count(False, bias)
        assert 2.4 < autocast / fused < 2.75
        ratios.append(bf16 / autocast)
    assert ratios == pytest.approx([114 / 226, 96 / 208])
    assert BF16_PARAMS_BYTES == pytest.approx(math.sqrt(ratios[0] * ratios[1]), abs=0.005)
    assert EAGER_BYTES == 2.5


GPT_1B = ModelShape(8, 2048, 16, 16, 32000, 2048, 4.0, False, name="gpt-1b", rotary=False)


@pytest.mark.parametrize("software", ["dtrain", "fsdp-eager"])
def test_the_trainer_under_fsdp_moves_bf16_params_bytes(software):
    """ZeRO-2/3 on the trainer's stacks: the layer's eager memory-bound bytes x BF16_PARAMS_BYTES,
    in layer_terms and in step_time; other software keeps autocast's."""
    cluster = Cluster.from_profile("h100-sxm", 1)
    stack = Stack("flash2", "eager", "eager", software=software)
    dev = device_of(cluster, Calibration(), stack)
    plain, sharded = Layout(micro_batch=8), Layout(micro_batch=8, zero_stage=3)
    want = {k: v * BF16_PARAMS_BYTES for k, v in memory_bytes(GPT_1B, plain, "bf16", False).items()}
    assert memory_bytes(GPT_1B, plain, "bf16", False, bf16_params=True) == pytest.approx(want)
    a, b = layer_terms(GPT_1B, plain, dev), layer_terms(GPT_1B, sharded, dev)
    assert b.memory == pytest.approx(a.memory * BF16_PARAMS_BYTES)
    ta, tb = (step_time(GPT_1B, lay, cluster, stack=stack).terms for lay in (plain, sharded))
    assert ta.memory - tb.memory == pytest.approx(8 * (a.memory - b.memory))
    other = Stack("flash2", "eager", "eager", software="torchtitan")
    odev = device_of(cluster, Calibration(), other)
    assert layer_terms(GPT_1B, sharded, odev).memory == layer_terms(GPT_1B, plain, odev).memory


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "nope"], "error: --preset nope: choose one of tiny, small, 125m"),
        (["--width", "6"], "error: --width 6: give a positive multiple of 4"),
        (["--widthx", "6"], "unrecognized arguments: --widthx 6"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, message, capsys):
    from dtrain.gpucheck.eager_bytes import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_cli_prints_the_counts(capsys):
    import json

    from dtrain.gpucheck.eager_bytes import main

    assert main(["--preset", "tiny", "--width", "64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bf16"]["bytes_per_d"] == pytest.approx(hand_count(False, False), abs=0.3)
    assert got["bf16_over_autocast_bytes"] == pytest.approx(
        got["bf16"]["bytes_per_d"] / got["autocast"]["bytes_per_d"]
    )
