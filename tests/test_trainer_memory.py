"""The trainer's activation counts under autocast (costmodel/stack_memory.autocast_layer_bytes)
by hand, and against what PyTorch itself saves and allocates on this CPU
(dtrain.gpucheck.saved_tensors)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dtrain.costmodel.measured_cases import eager_stack
from dtrain.costmodel.memory import memory_per_gpu
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.stack import Stack
from dtrain.costmodel.stack_memory import autocast_layer_bytes, memory_for, traced_layer

GPT = ModelShape(2, 512, 8, 8, 32000, 4096, rotary=False)  # F = 4h, r = 1
COMPILED = Stack("flash", "fused", "eager", software="dtrain", optimizer="foreach")


@pytest.mark.parametrize(
    "compiled, precision, per_h",
    [(False, "bf16", 40), (False, "fp8", 40), (True, "bf16", 34), (True, "fp8", 22)],
)
def test_block_counts_by_hand(compiled, precision, per_h):
    """eager 2 x 4h (fp32 norm inputs) + 4 x 2h (the norm output cast for q, k, v, fc1) + 8h (q,
    k, v, out) + 2 x 2F; compiled 4h + 2 x 2h + 8h + 2h + 2 x 2F; compiled FP8 4h + 8h + 2h + 2F."""
    got = autocast_layer_bytes(GPT, Layout(micro_batch=1), compiled, precision)
    assert got == pytest.approx(per_h * 512)


def test_grouped_kv_heads_shrink_k_and_v():
    gqa = ModelShape(2, 512, 8, 2, 32000, 4096, rotary=False)  # r = 1/4: k, v 2h/4 each
    assert autocast_layer_bytes(gqa, Layout(micro_batch=1), False, "bf16") == pytest.approx(
        (40 - 3) * 512
    )


def test_counted_where_the_trainer_runs_eager():
    from dtrain.costmodel.stack_memory import counted_block

    z3 = Layout(micro_batch=1, zero_stage=3, dp_shard=2)
    assert counted_block(GPT, z3, eager_stack())
    assert not counted_block(GPT, z3, COMPILED)  # compiled under FSDP2: not counted
    llama = ModelShape(2, 512, 8, 8, 32000, 4096, gated_mlp=True)
    assert not counted_block(llama, z3, eager_stack())


def test_traced_only_under_autocast_without_recompute():
    one = Layout(micro_batch=1)
    assert traced_layer(GPT, one, eager_stack()) and traced_layer(GPT, one, COMPILED)
    assert not traced_layer(GPT, Layout(micro_batch=1, zero_stage=3), COMPILED)
    assert not traced_layer(GPT, Layout(micro_batch=1, recompute="full"), COMPILED)
    assert not traced_layer(GPT, one, Stack("flash", "fused", software="torchtitan"))
    for other in (replace(GPT, rotary=True), replace(GPT, dropout=True)):  # not dtrain's block
        assert not traced_layer(other, one, COMPILED)


def test_fp8_keeps_no_bf16_block_weights():
    """torchao's Float8Linear casts its fp32 weight itself: the end of forward lacks autocast's
    2 B per block linear weight (the head's cast stays)."""
    lay = Layout(micro_batch=1)
    bf16 = memory_for(GPT, lay, eager_stack(), precision="bf16")
    fp8 = memory_for(GPT, lay, eager_stack(), precision="fp8")
    assert bf16.params - fp8.params == pytest.approx(2 * 2 * GPT.param_count.matmul_per_layer)


def test_compiled_activations_by_hand():
    """Compiled, the blocks keep 34h a token where eager keeps 40h (bf16) and 22h (FP8)."""
    lay = Layout(micro_batch=1)
    eager = memory_for(GPT, lay, eager_stack(), precision="bf16").activations
    for precision, per_h in (("bf16", 34), ("fp8", 22)):
        got = memory_for(GPT, lay, COMPILED, precision=precision).activations
        assert eager - got == pytest.approx(2 * (40 - per_h) * 4096 * 512)


def test_factor_applies_where_not_traced():
    """Elsewhere (FSDP: no autocast) the published FP8 runs' activation factor still scales the
    Korthikanti count."""
    z3 = Layout(micro_batch=1, zero_stage=3, dp_shard=2)
    base = memory_per_gpu(GPT, z3, 0.8, True, False)  # flash attention, the eager loss
    assert memory_for(GPT, z3, COMPILED, 0.8).activations == pytest.approx(base.activations)


def test_saved_tensors_match_the_count():
    """PyTorch's own saved tensors, eager under CPU autocast, LayerNorm preset (the same kernel as
    CUDA's): 40 x d_model per token and layer at two widths (+ the norm's per-token statistics)."""
    from dtrain.gpucheck.saved_tensors import saved

    for width in (256, 384):
        got = saved("125m", width)
        print("width", width, got)
        assert got["activations_per_d"] == pytest.approx(40.0, abs=0.2)
        assert got["weight_casts_per_d"] > 0  # autocast's bf16 weight copies, apart


def test_eager_step_peak_slopes():
    """A whole eager step's peak (the profiler's allocations): 12 B per logit and 2 x 40h + 6h per
    token (the two blocks, the final norm's fp32 input, the head's bf16 input)."""
    from dtrain.gpucheck.saved_tensors import peak_slopes

    got = peak_slopes("125m", 256)
    print(got)
    assert got["per_logit"] == pytest.approx(12.0, abs=0.1)
    assert got["per_token_per_d"] == pytest.approx(86.0, abs=0.5)


@pytest.mark.slow
def test_compiled_saved_tensors_match_the_count():
    pytest.importorskip("torchao")
    from dtrain.gpucheck.saved_tensors import saved

    assert saved("125m", 256, compiled=True)["activations_per_d"] == pytest.approx(34.0, abs=0.2)
    fp8 = saved("125m", 256, fp8=True, compiled=True)
    assert fp8["activations_per_d"] == pytest.approx(22.0, abs=0.2)
    assert fp8["weight_casts_per_d"] == 0


@pytest.mark.slow
def test_fsdp2_step_peak_is_the_count(monkeypatch):
    """Under FSDP2 (one gloo rank, bf16 parameters, no autocast) the step peaks at the count: the
    loss's 12 B per logit and Korthikanti's 32h a block, no 5% for temporaries."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    out = subprocess.run(
        [sys.executable, "-m", "dtrain.gpucheck.saved_tensors", "--peak", "--fsdp"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    print(data["peak"])
    assert data["peak"]["fsdp"] == 2
    assert data["peak"]["per_logit"] == pytest.approx(12.0, abs=0.1)
    # two blocks at Korthikanti's 32h (bf16 throughout) and the head's 4h: 68h counted
    assert data["peak"]["per_token_per_d"] == pytest.approx(68.0, abs=1.5)
