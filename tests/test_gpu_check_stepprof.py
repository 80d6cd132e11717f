"""The eager-step profiler of `make gpu-check` (dtrain.gpucheck.stepprof), its grouped-GEMM sweep
and the check's learning rule, on CPU: the GPU accounting from hand-made kernel records, the loss
rule from hand-made curves, the sweeps at CPU sizes."""

from __future__ import annotations

import json
import sys
from enum import Enum
from types import SimpleNamespace as NS

import pytest

from conftest import run_cmd
from dtrain.gpucheck.kernels import gpu_time_by_category
from dtrain.gpucheck.report import Step, loss_falls, profile_case_line, render
from dtrain.gpucheck.stepprof import ISSUE_TOKENS, PHASES, median_phases
from dtrain.gpucheck.timeline import (
    KernelRecord,
    account,
    annotation_name,
    gap_profile,
    kernel_records,
    union_ns,
)


class Dev(Enum):
    CPU = 0
    CUDA = 1


def _ev(name, start, dur, stream=7, device=Dev.CUDA, activity="kernel", annotation=False):
    return NS(
        name=lambda: name,
        start_ns=lambda: start,
        duration_ns=lambda: dur,
        device_resource_id=lambda: stream,
        device_type=lambda: device,
        activity_type=lambda: activity,
        is_user_annotation=lambda: annotation,
    )


def test_union_of_intervals_by_hand():
    assert union_ns([]) == 0
    assert union_ns([(0, 10), (5, 15), (20, 30)]) == 25  # [0,15) + [20,30)
    assert union_ns([(0, 100), (10, 20), (30, 40)]) == 100  # nested
    assert union_ns([(5, 6), (0, 5)]) == 6  # touching, unsorted


def test_kernel_records_drop_annotations_cpu_ops_and_repeats():
    """The bug of the first checks: the GPU annotation `Optimizer.step#AdamW.step` spans the
    optimizer's kernels and was summed with them (GPU busy 120-128% of the step)."""
    events = [
        _ev("sm90_xmma_gemm_bf16", 0, 4_000),
        _ev("sm90_xmma_gemm_bf16", 0, 4_000),  # the same record twice counts once
        _ev("multi_tensor_apply_kernel", 5_000, 2_000),
        _ev(
            "Optimizer.step#AdamW.step",
            5_000,
            2_000,
            activity="gpu_user_annotation",
            annotation=True,
        ),
        _ev("aten::mm", 0, 9_000, device=Dev.CPU, activity="cpu_op"),
        _ev("Memset (Device)", 7_000, 500, activity="gpu_memset"),
        _ev("flash_fwd_kernel", 2_000, 3_000, stream=13),  # another stream, overlapping the GEMM
    ]
    recs = kernel_records(events)
    assert sorted(r.name for r in recs) == [
        "Memset (Device)",
        "flash_fwd_kernel",
        "multi_tensor_apply_kernel",
        "sm90_xmma_gemm_bf16",
    ]
    acc = account(recs)
    assert acc["gpu_s_by_category"] == pytest.approx(
        {"gemm": 4e-6, "optimizer": 2e-6, "memcpy": 5e-7, "attention": 3e-6}
    )
    assert acc["kernels"] == 4 and acc["kernels_by_category"]["gemm"] == 1
    assert acc["gpu_kernel_sum_s"] == pytest.approx(9.5e-6)
    assert acc["gpu_busy_s"] == pytest.approx(7.5e-6)  # [0, 7000) + [7000, 7500)
    assert acc["streams"] == pytest.approx({"7": 6.5e-6, "13": 3e-6})


def test_per_name_rows_skip_gpu_annotations():
    cuda = NS(name="CUDA")
    rows = [
        NS(key="multi_tensor_apply_kernel", device_type=cuda, device_time_total=2000.0, count=9),
        NS(
            key="Optimizer.step#AdamW.step",
            device_type=cuda,
            device_time_total=2000.0,
            count=1,
            is_user_annotation=True,
        ),
    ]
    seconds, launches = gpu_time_by_category(rows)
    assert seconds == pytest.approx({"optimizer": 2e-3}) and launches == {"optimizer": 9}


def test_loss_rule_by_hand():
    assert loss_falls({"losses": [10.0, 9.0, 8.0, 7.0, 6.0]}) is None
    why = loss_falls({"losses": [11.2, 12.0, 13.0, 13.4, 13.4]})
    assert why == "the loss did not fall: 11.200 -> 13.267 (mean of the last 3)"
    # 2% lower is not enough: LOSS_DROP is 3%
    assert "did not fall" in loss_falls({"losses": [10.0, 9.8, 9.8, 9.8]})
    assert loss_falls({"losses": [10.0, 9.0]}) == "only 2 losses recorded"
    assert loss_falls({}) is None  # a step that records no losses is not judged


def test_eager_sweep_and_grouped_gemm_at_cpu_sizes():
    out = run_cmd([sys.executable, "-m", "dtrain.gpucheck.stepprof", "eager_sweep", "--small"])
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert [c["seq_len"] for c in d["cases"]] == [64, 128, 64]
    assert [c["precision"] for c in d["cases"]] == ["bf16", "bf16", "fp8"]
    for c in d["cases"]:
        # host issue time is part of the step's wall time, and each phase's host time part of
        # the issue time (in every step, so in the medians)
        assert 0 < c["cpu_dispatch_s"] <= c["step_s"] and c["params"] > 0
        assert list(c["phases"]) == list(PHASES)
        assert all(0 < p["host_s"] <= c["cpu_dispatch_s"] for p in c["phases"].values())
        # the host-issue probe: one sequence of at most ISSUE_TOKENS of the case's tokens
        assert c["issue_tokens"] == min(ISSUE_TOKENS, c["seq_len"]) and c["host_issue_s"] > 0
        assert all(p["gpu_s"] is None for p in c["phases"].values())  # no GPU: no CUDA events
        assert c["gpu_busy_s"] == 0 and c["kernels"] == 0  # no GPU: no kernel records
        assert c["gaps"] == 0 and c["largest_gaps"] == []
    line = profile_case_line(d["cases"][0])
    assert line.startswith("tiny s64 mb 2 foreach: step ") and "host issue" in line
    assert f"{d['cases'][0]['host_issue_s'] * 1e3:.1f} ms at 64 tokens" in line
    out = run_cmd([sys.executable, "-m", "dtrain.gpucheck.grouped", "--small"])
    g = json.loads(out.stdout.strip().splitlines()[-1])
    assert [p["tokens_per_expert"] for p in g["points"]] == [16, 32]
    for p in g["points"]:
        # the grouped kernel against the per-expert loop: the same rows, the same weights
        assert p["grouped_vs_loop_max_abs_err"] < 1e-4
        assert p["flops"] == 2 * p["experts"] * p["tokens_per_expert"] * p["k"] * p["n"]
    report = render(
        [Step("grouped_gemm", "g", [], 1, status="ok", data=g)], __import__("pathlib").Path(".")
    )
    assert "| tokens per expert | grouped_mm | per-expert loop | dense, same FLOPs |" in report


def test_profile_line_names_stream_overlap():
    c = {
        "preset": "1b",
        "overrides": {"n_layer": 8},
        "n_layer": 8,
        "seq_len": 2048,
        "micro_batch": 8,
        "optimizer": "foreach",
        "step_s": 0.1,
        "cpu_dispatch_s": 0.04,
        "gpu_busy_s": 0.09,
        "gpu_kernel_sum_s": 0.1,
        "streams": {"7": 0.08, "13": 0.02},
        "kernels": 1234,
        "peak_mem_bytes": 2**31,
        "gpu_s_by_category": {"gemm": 0.06},
    }
    assert profile_case_line(c) == (
        "1b/8L s2048 mb 8 foreach: step 100.0 ms (host issue 40.0 ms), GPU busy 90% (kernels on "
        "2 streams overlap 10%), 1,234 kernels, peak 2.0 GiB (gemm 60%)"
    )
    assert KernelRecord("k", 0, 1, 7).stream == 7
    # an FP8 case with its idle gaps and phases (the GPU's times from CUDA events)
    fp8 = {
        **c,
        "precision": "fp8",
        "gaps": 700,
        "gap_s": 0.012,
        "largest_gaps": [{"gap_s": 0.0015, "after": "cast_kernel", "before": "gemm"}],
        "phases": {
            "forward": {"host_s": 0.01, "gpu_s": 0.03},
            "optimizer": {"host_s": 0.005, "gpu_s": 0.02},
        },
    }
    line = profile_case_line(fp8)
    assert line.startswith("1b/8L s2048 mb 8 foreach fp8: step 100.0 ms")
    assert line.endswith(
        "(gemm 60%); GPU idle in 700 gaps, 12.0 ms, the longest 1.50 ms after cast_kernel; "
        "phases host/GPU ms: forward 10.0/30.0 optimizer 5.0/20.0"
    )


LAMBDA_KERNEL = (  # a cast as kineto names it: the demangled lambda carries '#'
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
    "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
    "{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, "
    "at::native::(anonymous namespace)::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
    "std::array<char*, 2ul>)"
)


@pytest.mark.parametrize(
    "name, annotation",
    [
        ("Optimizer.step#AdamW.step", True),
        ("Optimizer.zero_grad#AdamW.zero_grad", True),
        ("ProfilerStep#3", True),
        ("## forward ##", True),
        (LAMBDA_KERNEL, False),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", False),
        ("void at::native::(anonymous namespace)::GeluCUDAKernelImpl{lambda()#1}", False),
    ],
)
def test_annotation_names_against_kernel_names(name, annotation):
    """The 2026-11-27 records took any '#' for an annotation and dropped every lambda kernel."""
    assert annotation_name(name) is annotation


def test_kernel_records_on_torch_without_activity_type():
    """torch 2.11 (the GPU image's) has no ``activity_type`` on its events: annotations are then
    known by ``is_user_annotation`` or, lacking that too, by their ``record_function`` names."""
    kernel = NS(
        **{k: v for k, v in vars(_ev("sm90_xmma_gemm", 0, 10)).items() if k != "activity_type"}
    )
    ann = NS(
        **{
            k: v
            for k, v in vars(_ev("Optimizer.step#AdamW.step", 0, 10, annotation=True)).items()
            if k not in ("activity_type", "is_user_annotation")
        }
    )
    cast = NS(**{**vars(kernel), "name": lambda: LAMBDA_KERNEL})
    assert [r.name for r in kernel_records([kernel, ann, cast])] == [
        "sm90_xmma_gemm",
        LAMBDA_KERNEL,
    ]


def test_gap_profile_by_hand():
    """Busy stretches merge across streams; a gap is the time between two stretches, binned by
    length, the longest named by the records on either side."""
    recs = [
        KernelRecord("gemm_a", 0, 10_000, 7),
        KernelRecord("flash_fwd", 5_000, 12_000, 13),  # overlaps gemm_a: one stretch to 12 us
        KernelRecord("add", 13_000, 14_000, 7),  # 1 us gap
        KernelRecord("norm", 19_000, 20_000, 7),  # 5 us gap
        KernelRecord("Memcpy DtoH", 620_000, 621_000, 7),  # 600 us gap
        KernelRecord("adam", 641_000, 650_000, 7),  # 20 us gap
    ]
    g = gap_profile(recs, largest=2)
    assert g["gaps"] == 4 and g["gap_s"] == pytest.approx((1 + 5 + 600 + 20) * 1e-6)
    assert g["span_s"] == pytest.approx(650e-6)
    assert g["gap_bins"] == {
        "0-2us": {"count": 1, "s": pytest.approx(1e-6)},
        "2-10us": {"count": 1, "s": pytest.approx(5e-6)},
        "10-50us": {"count": 1, "s": pytest.approx(20e-6)},
        ">=500us": {"count": 1, "s": pytest.approx(600e-6)},
    }
    assert g["largest_gaps"] == [
        {"gap_s": pytest.approx(600e-6), "after": "norm", "before": "Memcpy DtoH"},
        {"gap_s": pytest.approx(20e-6), "after": "Memcpy DtoH", "before": "adam"},
    ]
    # the stretch that gemm_a opens is closed by flash_fwd, which ends last
    assert gap_profile(recs[:3])["largest_gaps"][0] == {
        "gap_s": pytest.approx(1e-6),
        "after": "flash_fwd",
        "before": "add",
    }
    assert gap_profile([]) == {
        "gaps": 0,
        "gap_s": 0.0,
        "span_s": 0.0,
        "gap_bins": {},
        "largest_gaps": [],
    }


def test_top_kernels_by_gpu_time():
    from dtrain.gpucheck.timeline import KernelRecord, top_kernels

    recs = [
        KernelRecord("elementwise_kernel<abs>", 0, 4_000, 7),
        KernelRecord("sm90_xmma_gemm_bf16", 4_000, 9_000, 7),
        KernelRecord("elementwise_kernel<abs>", 9_000, 12_000, 7),
        KernelRecord("reduce_kernel<max>", 12_000, 13_000, 7),
    ]
    rows = top_kernels(recs, top=2)["top_kernels"]
    # abs: 2 launches, 4 + 3 us, ahead of the GEMM's one 5 us; the reduction is cut at top=2
    assert [(r["name"], r["launches"]) for r in rows] == [
        ("elementwise_kernel<abs>", 2),
        ("sm90_xmma_gemm_bf16", 1),
    ]
    assert rows[0]["s"] == pytest.approx(7e-6) and rows[1]["s"] == pytest.approx(5e-6)
    assert rows[1]["category"] == "gemm"
    assert top_kernels([]) == {"top_kernels": []}


def test_median_phases_by_hand():
    def step(k):
        return {p: {"host_s": k * (i + 1), "gpu_s": 2 * k * (i + 1)} for i, p in enumerate(PHASES)}

    m = median_phases([step(1), step(3), step(2)])
    assert m["forward"] == {"host_s": 4, "gpu_s": 8}  # forward is the 2nd phase: 2 x median 2
    cpu = [{p: {"host_s": 1.0, "gpu_s": None} for p in PHASES}]
    assert median_phases(cpu)["optimizer"] == {"host_s": 1.0, "gpu_s": None}
