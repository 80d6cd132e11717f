"""The compute terms (costmodel/compute.py) against hand-computed values, and against one measured
GPU.

Each hand value below is written from the module docstring's formulas with the H100 numbers of
hardware.yaml (989.4 TFLOP/s bf16, 1978.9 fp8, 3.35 TB/s) and kernels.yaml (shares), not by
calling the code under test; the last tests reproduce steps profiled on an H100 and on an H200
(measured/, make gpu-check)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from dtrain.costmodel.attention_time import attention_s
from dtrain.costmodel.compute import CLIP_BYTES, OPTIMIZER_BYTES, optimizer_s
from dtrain.costmodel.kernel_rates import published
from dtrain.costmodel.memory_bound import EAGER_BYTES, memory_bytes
from dtrain.costmodel.model_states import embedding_params_per_gpu, params_per_gpu
from dtrain.costmodel.calibration import Calibration
from dtrain.costmodel.efficiency import Gemm
from dtrain.costmodel.gpt_shape import shape_of
from dtrain.costmodel.hardware import Cluster
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.stack import Stack
from dtrain.costmodel.device_rates import device_of
from dtrain.costmodel.timemodel import step_time

ROOT = Path(__file__).resolve().parents[1]
H100_PROFILE = "measured/h100-sxm/gpu-check-20261125-105450"  # make gpu-check reports, committed
H200_PROFILE = "measured/h200/gpu-check-20261126-021500"
H100 = Cluster.from_profile("h100-sxm", 8, 8)
PEAK, PEAK_FP8, HBM = 989.4e12, 1978.9e12, 3.35e12
LLAMA8B = ModelShape(32, 4096, 32, 8, 128256, 8192, 3.5, True, name="llama3-8b")


def dev(stack: Stack = Stack()):
    return device_of(H100, Calibration(), stack)


def test_h100_rates_are_the_datasheet_ones():
    d = dev()
    assert d.peak_bf16 == pytest.approx(PEAK) and d.hbm_Bps == pytest.approx(HBM)
    assert d.peak_fp8 == pytest.approx(PEAK_FP8)


@pytest.mark.parametrize("cp, impl", [(1, "ring"), (2, "ring"), (4, "ring"), (4, "ulysses")])
def test_fused_attention_is_causal_flops_over_the_benchmark_rate(cp, impl):
    """forward 2·2·b·heads·s²·hd / 2 (causal), backward 2.5x: 3.5x in all; 1/cp per rank; the
    ring's kernels run over s/cp tokens, Ulysses' over the whole sequence (flash: e(s) =
    0.59·s/(s + 1300), hd 128)."""
    s, b, heads, hd = 8192, 2, 32, 128
    work = 3.5 * 2 * 2 * b * heads * s * s * hd / 2 / cp
    call = s // cp if impl == "ring" else s
    share = 0.59 * call / (call + 1300)
    d = dev()
    expected = work / (PEAK * share) * d.power_scale
    got = attention_s(LLAMA8B, Layout(cp=cp, micro_batch=b, cp_impl=impl), d)
    assert got == pytest.approx(expected, rel=1e-9)


def test_fused_attention_forward_alone_is_two_sevenths():
    d, lay = dev(), Layout(tp=2, micro_batch=1)
    assert attention_s(LLAMA8B, lay, d, forward_only=True) == pytest.approx(
        attention_s(LLAMA8B, lay, d) / 3.5
    )


def test_attention_dropout_in_a_fused_kernel_costs_its_measured_multiplier():
    """kernels.yaml's attention ``dropout`` (a gpu-check measurement) multiplies the fused
    kernel's time of a model trained with dropout, and nothing else; where no GPU measured it
    (the A100's curves), it is 1."""
    from dataclasses import replace

    d, lay = dev(), Layout(tp=2, micro_batch=1)
    gpt3 = replace(LLAMA8B, dropout=True)
    assert d.kernels.attention.dropout == 1.46
    assert attention_s(gpt3, lay, d) == pytest.approx(
        1.46 * attention_s(LLAMA8B, lay, d), rel=1e-12
    )
    assert published("h100-sxm", "flash2").attention.dropout == 1.18
    assert published("h200").attention.dropout == 1.46  # the same GH100 SMs: one measurement
    assert published("a100-80gb").attention.dropout == 1.0  # not measured: not priced


def test_the_dropout_multipliers_are_the_h200_attention_sweep_medians():
    """kernels.yaml's numbers are what gpu-check's report reads from the committed H200 sweep:
    the median time ratio over s = 1024 ... 16384, cuDNN's for the Hopper `flash` curve,
    FlashAttention-2's for `flash2`."""
    from dtrain.gpucheck.attention_dropout import dropout_slowdown

    steps = {s["name"]: s for s in json.loads((ROOT / H200_PROFILE / "report.json").read_text())}
    slow = dropout_slowdown(steps["attention_sweep"]["data"]["points"])
    assert slow["cudnn"][0] == (1024, 2048, 4096, 8192, 16384)
    assert round(slow["cudnn"][1], 2) == published("h100-sxm").attention.dropout
    assert round(slow["flash"][1], 2) == published("h100-sxm", "flash2").attention.dropout


def test_gpu_check_reads_the_dropout_multiplier_as_the_median_over_training_lengths():
    from dtrain.gpucheck.attention_dropout import dropout_slowdown

    pt = lambda backend, seq, p, t, causal=True, hd=128: {  # noqa: E731
        "backend": backend,
        "seq": seq,
        "dropout_p": p,
        "fwd_bwd_s": t,
        "causal": causal,
        "head_dim": hd,
        "kv_heads": 16,
    }
    points = [
        pt("flash", 512, 0.0, 1.0),
        pt("flash", 512, 0.1, 3.0),  # shorter than training: left out
        pt("flash", 2048, 0.0, 1.0),
        pt("flash", 2048, 0.1, 1.1),
        pt("flash", 4096, 0.0, 1.0),
        pt("flash", 4096, 0.1, 1.3),
        pt("flash", 8192, 0.0, 4.0),
        pt("flash", 8192, 0.1, 5.0),
        pt("flash", 8192, 0.0, 2.0, causal=False),
        pt("cudnn", 8192, 0.0, 3.0),
        {**pt("flash", 8192, 0.0, 9.0), "kv_heads": 2},  # a GQA point: another kernel
        {
            "backend": "cudnn",
            "seq": 8192,
            "dropout_p": 0.1,
            "causal": True,
            "head_dim": 128,
            "error": "no",
        },
    ]
    assert dropout_slowdown(points) == {"flash": ((2048, 4096, 8192), pytest.approx(1.25))}


def test_memory_bound_bytes_per_layer_by_hand():
    """Llama-3-8B layer, tp 2 with SP, b=1, s=8192: per token norm 20·h/t, add 24·h/t, SwiGLU
    16·F/t, RoPE 8·(q + kv heads)·hd on the rank (16 + 4 heads of 128)."""
    lay = Layout(tp=2, micro_batch=1, sequence_parallel=True)
    tokens, h_r, f = 8192, 4096 / 2, 3.5 * 4096 / 2
    want = {
        "norm": 20 * h_r * tokens,
        "add": 24 * h_r * tokens,
        "act_swiglu": 16 * f * tokens,
        "rope": 8 * (16 + 4) * 128 * tokens,
    }
    got = memory_bytes(LLAMA8B, lay, "bf16", fused=True)
    assert got == pytest.approx(want, rel=1e-12)
    eager = memory_bytes(LLAMA8B, lay, "bf16", fused=False)
    assert eager == pytest.approx({k: v * EAGER_BYTES for k, v in want.items()}, rel=1e-12)


def test_fp8_casts_count_each_block_linears_input_and_output_gradient():
    """elements per token: qkv (in h, out-grad q+2kv) + proj (q + h) + fc1 (h + 2F) + fc2 (F +
    h), at 11.5 B per element with dynamic scaling (torchao), 3 with delayed (TransformerEngine),
    fused or eager alike (the casts' own count: not scaled again by EAGER_BYTES)."""
    lay = Layout(micro_batch=1)
    q, kv, h, f = 32 * 128, 8 * 128, 4096, 3.5 * 4096
    elems = (h + q + 2 * kv) + (q + h) + (h + 2 * f) + (f + h)
    for fused in (True, False):
        assert memory_bytes(LLAMA8B, lay, "fp8", fused, "dynamic")["fp8_cast"] == pytest.approx(
            11.5 * elems * 8192
        )
        assert memory_bytes(LLAMA8B, lay, "fp8", fused, "delayed")["fp8_cast"] == pytest.approx(
            3.0 * elems * 8192
        )


def test_fp8_scaling_follows_the_software_unless_given():
    """torchtitan and dtrain run torchao's dynamic scaling, Megatron (TransformerEngine) and
    "any" delayed; a given scaling wins; the device the step is priced on carries it; an unknown
    one is refused."""
    assert [
        Stack(software=s).fp8_casts for s in ("torchtitan", "dtrain", "megatron-core", "any")
    ] == ["dynamic", "dynamic", "delayed", "delayed"]
    # the eager stack runs the same recipe without compile: its casts op by op
    assert Stack(software="fsdp-eager").fp8_casts == "eager"
    assert Stack(software="torchtitan", fp8_scaling="delayed").fp8_casts == "delayed"
    assert (
        device_of(
            Cluster.from_profile("h100-sxm", 8), Calibration(), Stack(software="torchtitan")
        ).fp8_scaling
        == "dynamic"
    )
    with pytest.raises(
        ValueError, match="fp8_scaling='per-row' must be one of delayed, dynamic, eager, None"
    ):
        Stack(fp8_scaling="per-row")


PROBE = (
    Path(__file__).resolve().parents[1]
    / "measured"
    / "h200"
    / "probe-20261126-0510"
    / "layer_probe_mb123.json"
)


def _probe_pairs():
    """(case, micro-batch, bf16 record, fp8 record) of the H200 layer probe the FP8 constants
    come from."""
    cases = json.loads(PROBE.read_text())["cases"]
    by = {(c["case"], c["precision"], c["micro_batch"]): c for c in cases}
    return [(n, mb, by[(n, "bf16", mb)], by[(n, "fp8", mb)]) for (n, p, mb) in by if p == "bf16"]


def test_fp8_cast_bytes_are_the_h200_probes_geometric_mean():
    """FP8_CAST_BYTES["dynamic"] re-derived from the committed probe: per case, the FP8 block's
    elementwise GPU time minus the bf16 block's, less the weights' casts (13 B per weight with
    full AC: FP8_WEIGHT_CAST_BYTES 8 plus the recompute's forward 5), over the model's cast time
    per byte (cast elements x tokens x 1.5 for the full-AC recompute of the forward's half), both
    at the H200's add rate; then the geometric mean of the six."""
    from dtrain.costmodel.kernel_rates import published
    from dtrain.costmodel.memory_bound import FP8_CAST_BYTES, FP8_WEIGHT_CAST_BYTES

    bw = 4.8e12 * published("h200").memory["add"]
    xs = []
    for _, mb, bf16, fp8 in _probe_pairs():
        hd = bf16["d_model"] // bf16["heads"]
        q, kv, h, f = (
            (bf16["heads"] // bf16["tp"]) * hd,
            max(bf16["kv_heads"] // bf16["tp"], 1) * hd,
            bf16["d_model"],
            bf16["ffn"] // bf16["tp"],
        )
        elems = (h + q + 2 * kv) + (q + h) + (h + 2 * f) + (f + h)
        weights = h * (q + 2 * kv) + q * h + 3 * h * f
        extra = fp8["gpu_s_by_category"]["elementwise"] - bf16["gpu_s_by_category"]["elementwise"]
        xs.append(
            (extra - (FP8_WEIGHT_CAST_BYTES + 5) * weights / bw)
            / (1.5 * elems * bf16["seq"] * mb / bw)
        )
    assert len(xs) == 6 and 8 < min(xs) and max(xs) < 18
    assert FP8_CAST_BYTES["dynamic"] == pytest.approx(
        math.exp(statistics.fmean(math.log(x) for x in xs)), abs=0.05
    )


def test_dynamic_scaling_casts_the_weights_on_the_layer_unless_fsdp_gathers_them_in_fp8():
    """Llama-3-8B, one layer, tp=1, full recompute, on an H100: dynamic scaling (torchtitan) adds
    8 B per block weight (forward 5, backward 3) at the add rate, and the recompute's forward 5
    again; FSDP gathering the weights in FP8 (tp+fsdp, ZeRO 3) moves the cast off the layer and
    leaves the input gradient's transposed copy, 2 B, which the recompute does not repeat; delayed
    scaling (TransformerEngine) has none. step_time applies it (its per-micro-batch layout keeps
    the ZeRO stage) and adds the shard's cast before each gather, 5 B per element of the rank's
    eighth, twice a micro-batch under ZeRO-3."""
    from dataclasses import replace as dc_replace

    from dtrain.costmodel.compute import layer_terms

    weights = (
        4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    )  # linears + 2 norms
    assert LLAMA8B.params_per_layer_on_rank(1) == weights
    cluster = Cluster.from_profile("h100-sxm", 8)
    lay = Layout(dp_shard=8, zero_stage=3, recompute="full", micro_batch=1)

    def terms(**stack):
        return layer_terms(LLAMA8B, lay, device_of(cluster, Calibration(), Stack(**stack)), "fp8")

    titan, gathered = (
        terms(software="torchtitan"),
        terms(software="torchtitan", fp8_all_gather="tp+fsdp"),
    )
    dev = device_of(cluster, Calibration(), Stack(software="torchtitan"))
    cast, copy = dev.mem_s(8.0 * weights, "add"), dev.mem_s(2.0 * weights, "add")
    assert titan.memory - gathered.memory == pytest.approx(cast - copy)
    assert titan.recompute - gathered.recompute == pytest.approx(cast * 5 / 8)
    step = {
        gather: step_time(
            LLAMA8B,
            lay,
            cluster,
            Calibration(),
            "fp8",
            stack=Stack(software="torchtitan", fp8_all_gather=gather),
        )
        for gather in ("tp", "tp+fsdp")
    }
    shard_casts = 2 * dev.mem_s(5.0 * 32 * weights / 8, "add")
    casts = {k: t.terms.memory - t.fsdp_copy_out for k, t in step.items()}
    assert casts["tp"] - casts["tp+fsdp"] == pytest.approx(32 * (cast - copy) - shard_casts)
    # FSDP2's copy-outs of the two gathers: the block linears' weights 1 B each in FP8, not 2
    linears = params_per_gpu(LLAMA8B, 1, 1) - embedding_params_per_gpu(LLAMA8B, 1, 1)
    assert step["tp"].fsdp_copy_out - step["tp+fsdp"].fsdp_copy_out == pytest.approx(
        2 * dev.mem_s(2 * linears, "add")
    )
    zero0 = layer_terms(
        LLAMA8B,
        dc_replace(lay, zero_stage=0),
        device_of(cluster, Calibration(), Stack(software="torchtitan", fp8_all_gather="tp+fsdp")),
        "fp8",
    )
    assert zero0.memory == pytest.approx(
        titan.memory
    )  # nothing gathers the weights: cast at each use
    from dtrain.costmodel.memory_bound import (
        MEMORY_KIND,
        memory_widths,
    )  # delayed: the per-token bytes alone, no weight cast on the layer

    mega = device_of(cluster, Calibration(), Stack(software="megatron-core"))
    lay0 = dc_replace(lay, zero_stage=0)
    widths = memory_widths(LLAMA8B, lay0)
    per_token = sum(
        mega.mem_s(v, MEMORY_KIND[k], widths.get(k))
        for k, v in memory_bytes(LLAMA8B, lay0, "fp8", True, "delayed").items()
    )
    assert layer_terms(LLAMA8B, lay0, mega, "fp8").memory == pytest.approx(per_token)


def test_hopper_fp8_gemm_share_is_the_probes_median_against_bf16():
    """kernels.yaml's Hopper gemm_fp8 e_max = the bf16 e_max x the median over the probe's six
    blocks of the FP8 GEMMs' share of their (doubled) peak against the bf16 GEMMs': (bf16 GEMM
    time / FP8 GEMM time) / 2."""
    from dtrain.costmodel.kernel_rates import published

    ratio = statistics.median(
        b["gpu_s_by_category"]["gemm"] / f["gpu_s_by_category"]["gemm"] / 2
        for _, _, b, f in _probe_pairs()
    )
    assert 0.95 < ratio < 0.99
    for gpu in ("h100-sxm", "h100-pcie", "h100-nvl", "h200"):
        k = published(gpu)
        assert k.gemm["fp8"].e_max == pytest.approx(round(k.gemm["bf16"].e_max * ratio, 2))


def test_torch_cp_merges_count_the_ring_steps_eager_ops():
    """PyTorch's context_parallel, cp=4, Llama-3-8B (32 heads of 128 = 4096 per token as SDPA gets
    them), s=32768:
    per local token forward (3 later steps x 40.5 + 12) x 4096 = 133.5 x 4096, backward (3 x 58.5
    + 76) x 4096 = 251.5 x 4096, over the 8192 local tokens; the same count fused or eager; none
    for the ring and all-to-all implementations (their kernels merge in place) or without CP.
    Full recompute re-runs the forward merges, selective recompute too (the attention core with
    them), op AC none (SDPA's output is saved)."""
    from dataclasses import replace
    from dtrain.costmodel.compute import layer_terms

    shape = replace(LLAMA8B, seq_len=32768)
    local = replace(
        LLAMA8B, seq_len=8192
    )  # memory_bytes counts a rank's tokens (as layer_terms passes them)
    lay = Layout(cp=4, micro_batch=1, cp_impl="torch")
    for fused in (True, False):
        got = memory_bytes(local, lay, "bf16", fused=fused)
        assert got["cp_merge_fwd"] == pytest.approx(133.5 * 4096 * 8192)
        assert got["cp_merge_bwd"] == pytest.approx(251.5 * 4096 * 8192)
    for impl in ("ring", "ulysses"):
        assert not any(
            k.startswith("cp_merge")
            for k in memory_bytes(local, replace(lay, cp_impl=impl), "bf16", True)
        )
    assert not any(
        k.startswith("cp_merge") for k in memory_bytes(local, replace(lay, cp=1), "bf16", True)
    )
    d = dev()
    merge_fwd = 133.5 * 4096 * 8192 / (HBM * 0.89)  # kernels.yaml h100 "add" share
    merge_bwd = 251.5 * 4096 * 8192 / (HBM * 0.89)
    ring = layer_terms(shape, replace(lay, cp_impl="ring"), d)
    torch_cp = layer_terms(shape, lay, d)
    assert torch_cp.memory - ring.memory == pytest.approx(merge_fwd + merge_bwd, rel=1e-9)
    for rc, extra in (("full", merge_fwd), ("selective", merge_fwd), ("op", 0.0)):
        a, b = (
            layer_terms(shape, replace(lay, recompute=rc), d),
            layer_terms(shape, replace(lay, recompute=rc, cp_impl="ring"), d),
        )
        assert a.recompute - b.recompute == pytest.approx(extra, rel=1e-9, abs=1e-12)


def test_optimizer_is_bytes_over_the_measured_adamw_bandwidth():
    """fused AdamW at 0.74 of HBM, PyTorch's foreach default (eager stacks) at 0.27; 28 B per
    parameter of the rank's optimizer shard, 12 B of clipping per local parameter."""
    sharded, local = 1e9 / 8, 1e9
    nbytes = OPTIMIZER_BYTES * sharded + CLIP_BYTES * local
    assert OPTIMIZER_BYTES == 28 and CLIP_BYTES == 12
    assert optimizer_s(sharded, local, dev()) == pytest.approx(nbytes / (HBM * 0.74))
    assert optimizer_s(sharded, local, dev(Stack("flash", "eager"))) == pytest.approx(
        nbytes / (HBM * 0.27)
    )


def test_fp8_gemm_runs_at_the_fp8_peak_on_its_own_curve():
    """A 8192³ GEMM: 2mnk FLOPs at e_max·W/(W + W_half) of the dtype's peak (bf16 0.82, 4.8
    GFLOP; fp8 0.80, 9.6 GFLOP), over the sustained-clock share (0.885)."""
    g, d = Gemm(8192, 8192, 8192), dev()
    w = 2 * 8192**3
    assert d.gemm_s(g, "bf16") == pytest.approx(w / (PEAK * 0.82 * w / (w + 4.8e9)) * d.power_scale)
    assert d.gemm_s(g, "fp8") == pytest.approx(
        w / (PEAK_FP8 * 0.80 * w / (w + 9.6e9)) * d.power_scale
    )
    assert d.power_scale == pytest.approx(1 / published("h100-sxm").sustained)


def test_a_lower_power_cap_slows_compute_by_the_cube_root_of_the_power_above_idle():
    """h100-pcie's 350 W against the 700 W its kernel table assumes... has its own table at 350
    W: no scale; an H100 SXM profile capped to 350 W runs ((700 - 78)/(350 - 78))^(1/3) = 1.32x
    slower on compute-bound kernels: the clock's cube root follows the power above the 78 W the
    board draws idle."""
    from dataclasses import replace

    capped = replace(H100, gpu=replace(H100.gpu, power_w=350))
    full, slow = dev(), device_of(capped, Calibration(), Stack())
    assert slow.power_scale / full.power_scale == pytest.approx((622 / 272) ** (1 / 3))
    assert device_of(
        Cluster.from_profile("h100-pcie", 8, 8), Calibration(), Stack()
    ).power_scale == pytest.approx(full.power_scale)
    assert published("a100-80gb").power_scale(300) == pytest.approx(
        (400 / 300) ** (1 / 3)
    )  # no idle measured


def test_the_idle_draw_is_the_h200_clock_traces_median():
    """kernels.yaml's idle_w is the median power.draw of the committed nvidia-smi trace while the
    SMs idled (clock <= 400 MHz): a measurement, not a fitted number."""
    import csv
    import statistics

    trace = ROOT / "measured/h200/clocks-20261126-023259/clocks.csv"
    rows = [r for r in csv.reader(trace.open()) if not r[0].startswith("timestamp")]
    idle = [float(r[3]) for r in rows if float(r[1]) <= 400]
    assert len(idle) > 500
    assert (
        round(statistics.median(idle))
        == published("h200").idle_w
        == published("h100-sxm").idle_w
        == 78
    )


def _profiled_steps(report: str = H100_PROFILE):
    steps = {s["name"]: s for s in json.loads((ROOT / report / "report.json").read_text())}[
        "step_profile"
    ]
    return steps["data"]["cases"]


def _predicted_step(c: dict, gpu: str) -> float:
    from dtrain.model.gpt import GPTConfig

    cfg = GPTConfig.from_preset(c["preset"], **c["overrides"])
    assert (cfg.n_layer, cfg.d_model, cfg.seq_len) == (c["n_layer"], c["d_model"], c["seq_len"])
    pred = step_time(
        shape_of(cfg),
        Layout(zero_stage=0, recompute="none", micro_batch=c["micro_batch"], grad_accum=1),
        Cluster.from_profile(gpu, 1, 8),
        stack=Stack("flash", "eager"),
    ).total
    print(
        f"{gpu} {c['preset']} L{c['n_layer']} mb{c['micro_batch']}: measured "
        f"{c['step_s'] * 1e3:.1f} ms (GPU busy {c['gpu_busy_s'] * 1e3:.1f}), predicted "
        f"{pred * 1e3:.1f} ms ({pred / c['step_s'] - 1:+.0%})"
    )
    return pred


def test_single_gpu_steps_measured_on_an_h100_are_predicted_within_15pct():
    """dtrain's GPT (SDPA attention, no compile, foreach AdamW) profiled on one H100 80GB HBM3:
    125M at mb 8, a 1B model cut to 8 layers, a 7B model cut to 4 layers at mb 1 and 2. The eager
    stack prices the unfused elementwise kernels, the unfused loss and foreach AdamW; the step is
    the compute alone (one GPU). Measured in measured/h100-sxm/gpu-check-20261125-105450
    (step_profile)."""
    cases = _profiled_steps()
    assert len(cases) == 4
    for c in cases:
        err = _predicted_step(c, "h100-sxm") / c["step_s"] - 1
        assert abs(err) < 0.15, c


def test_steps_measured_on_an_h200_the_model_was_not_built_from_are_predicted_within_10pct():
    """The same four steps on one H200 (measured/h200/gpu-check-20261126-021500), a GPU no compute
    share was fitted to (its GEMM and attention shares are the H100's; its memory-bound shares are
    its own kernel benchmarks, no training step). The three GPU-bound steps land within 10%. The
    125M step is not GPU-bound:
    the GPU idles 9% of it (busy 33.7 of 37.0 ms, the same 37 ms as on the H100 with a third less
    HBM bandwidth): eager PyTorch's per-op dispatch (12.4 us for a tiny op there, `membound`)
    sets its pace, a term the model does not price."""
    cases = {(c["preset"], c["micro_batch"]): c for c in _profiled_steps(H200_PROFILE)}
    assert len(cases) == 4
    small = cases.pop(("125m", 8))
    assert small["gpu_busy_s"] < 0.95 * small["step_s"]  # dispatch-bound: why it is left out
    for c in cases.values():
        assert c["gpu_busy_s"] > c["step_s"]  # the GPU never waits (profiled kernel time overlaps)
        err = _predicted_step(c, "h200") / c["step_s"] - 1
        assert abs(err) < 0.10, c


def test_a_model_whose_sharded_states_exceed_hbm_is_refused_without_timing_a_layout():
    """16 B per parameter over all GPUs (ZeRO-3 of every state) is the least any layout keeps:
    405B on 64 H100s needs 16·405e9/64 = 94 GiB > 72 usable. The pruned search (the matrix's)
    says so at once; the exhaustive one finds no fitting layout either."""
    from dtrain.costmodel.search import search

    shape = ModelShape.from_params(405e9)
    cluster = Cluster.from_profile("h100-sxm", 64, 8)
    fast = search(shape, cluster, 1024, prune=True)
    assert fast.best is None and fast.ranked == []
    floor = 16 * shape.num_params() / 64 / 2**30
    assert f"need {floor:.1f} GiB per GPU > 72.0 GiB usable" in fast.reason
    assert search(shape, cluster, 1024).best is None


def test_weight_gathers_per_step_by_zero_stage():
    """One home for how often a step gathers the weights (the DP traffic and FSDP's FP8 shard
    casts both count them): 4 micro-batches."""
    from dtrain.costmodel.comm_time import weight_gathers_per_step as gathers

    def lay(zero, pp=1):
        return Layout(dp_shard=8, zero_stage=zero, pp=pp, grad_accum=4)

    assert [gathers(lay(z)) for z in (0, 1, 2, 3)] == [0, 1, 1, 8]
    assert gathers(lay(2), zero2_regathers=True) == 4  # FSDP2 without resharding after forward
    assert gathers(lay(3, pp=2)) == 1  # a stage keeps its weights gathered across micro-batches
