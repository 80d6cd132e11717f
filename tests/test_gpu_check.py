"""`make gpu-check` without a GPU (one line, exit 2), the bundle's size guard, and the check's parts
on CPU: time limits, measurement arithmetic, reading real run summaries, the report."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cmd
from dtrain.gpucheck import measure
from dtrain.gpucheck.__main__ import run_step
from dtrain.gpucheck.check_step import Step
from dtrain.gpucheck.report import loss_falls, render
from dtrain.gpucheck.step_list import steps

NO_GPU = (
    "error: make gpu-check needs a CUDA GPU, and torch here sees none (torch.cuda.is_available() "
    "is False)"
)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_check_without_a_gpu_is_one_line(tmp_path):
    out = run_cmd(
        [str(REPO / "scripts" / "gpu-check")], env={"PYTHON": sys.executable}, timeout=120
    )
    assert out.returncode == 2 and out.stderr.strip() == NO_GPU and out.stdout == ""
    out = run_cmd(
        [sys.executable, "-m", "dtrain.gpucheck", "--results", str(tmp_path)], timeout=120
    )
    assert out.returncode == 2 and out.stderr.strip() == NO_GPU and not any(tmp_path.iterdir())
    # its options are read without a GPU (and without the wheel bundle)
    out = run_cmd(
        [str(REPO / "scripts" / "gpu-check"), "--help"], env={"PYTHON": sys.executable}, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m dtrain.gpucheck")
    assert "--only ONLY" in out.stdout and out.stderr == ""


def test_only_runs_the_steps_in_the_order_asked_and_refuses_an_unknown_one(
    tmp_path, monkeypatch, capsys
):
    """A short GPU lease measures what matters most first: --only's order is the run order; a
    misspelt step is one line and exit 2 before the GPU is asked for or a folder made."""
    import torch

    from dtrain.gpucheck import __main__ as gc

    assert gc.main(["--results", str(tmp_path), "--only", "copy,attention_sweep,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: --only names no step nope: pick from env, copy, ")
        and "\n" not in err
    )
    assert not any(tmp_path.iterdir())
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fake_run(step, run_dir, deadline):
        ran.append(step.name)
        step.status = "ok"
        return step

    monkeypatch.setattr(gc, "run_step", fake_run)
    monkeypatch.setattr(gc, "render", lambda done, run_dir: "report")
    assert gc.main(["--results", str(tmp_path), "--only", "membound,copy,gemm_bf16"]) == 0
    assert ran == ["membound", "copy", "gemm_bf16"]


def test_bundle_size_guard(tmp_path):
    (tmp_path / "small-1.0-py3-none-any.whl").write_bytes(b"x" * 1024)
    ok = run_cmd([str(REPO / "scripts" / "gpu-bundle-size"), str(tmp_path), str(64 << 20)])
    assert ok.returncode == 0 and "bundle: " in ok.stdout and "(limit 64 MiB)" in ok.stdout
    with open(
        tmp_path / "big-1.0-py3-none-any.whl", "wb"
    ) as f:  # sparse: 64 MiB without writing them
        f.truncate(64 << 20)
    big = run_cmd([str(REPO / "scripts" / "gpu-bundle-size"), str(tmp_path), str(64 << 20)])
    assert big.returncode == 2
    assert (
        big.stderr.strip()
        == f"error: the bundle in {tmp_path} is 64.0 MiB, over the 64 MiB limit: drop or pin "
        "smaller wheels"
    )


def test_every_step_is_bounded_and_the_whole_fits_in_30_minutes(tmp_path):
    all_steps = steps(tmp_path)
    assert all(0 < s.limit_s <= 600 for s in all_steps)
    names = {s.name for s in all_steps}
    assert {
        "copy",
        "gemm_bf16",
        "gemm_fp8",
        "mfu_single",
        "mfu_zero3",
        "emulated_bf16",
        "tp_attention",
        "allreduce_nccl",
        "gpu_tests",
        "fp8_torchao_tensorwise_compile_true",
        "fp8_bf16_compile_false",
    } <= names
    slow = Step(
        "sleeper", "sleeps", [sys.executable, "-c", "import time; time.sleep(60)"], limit_s=2
    )
    t0 = time.monotonic()
    assert run_step(slow, tmp_path, deadline=time.monotonic() + 100).status == "timed out"
    assert time.monotonic() - t0 < 30
    late = Step("late", "never starts", [sys.executable, "-c", "pass"], limit_s=10)
    assert run_step(late, tmp_path, deadline=time.monotonic() + 5).status == "skipped"


def test_measurement_arithmetic_on_cpu():
    g = measure.gemm_bf16(n=64, warmup=1, iters=3)
    assert g["tflops"] == pytest.approx(2 * 64**3 / g["median_s"] / 1e12)
    c = measure.copy_bandwidth(nbytes=1 << 20, warmup=1, iters=3)
    assert c["GBps_read_plus_write"] == pytest.approx(2 * (1 << 20) / c["median_s"] / 1e9)
    f = measure.gemm_fp8(
        n=64, warmup=1, iters=2
    )  # torch._scaled_mm with the GPU call's layout and scales
    assert f["max_rel_err_vs_fp32"] < 1e-2 and f["tflops"] > 0


def _cpu_step(name, kind, args):
    return Step(
        name, name, [sys.executable, "-m", *args, "world_size=1", "device=cpu"], 240, kind=kind
    )


@pytest.mark.slow
def test_summaries_of_real_runs_are_read_and_reported(tmp_path):
    """The same subprocess + collect path as on the GPU, with tiny CPU runs of each subproject."""
    run = [
        Step("env", "the machine", [sys.executable, "-m", "dtrain.gpucheck.measure", "env"], 60),
        _cpu_step(
            "mfu_single",
            "fsdp",
            [
                "fsdp_scaling",
                "model.preset=tiny",
                "train.strategy=single",
                "train.steps=8",
                "profile.enabled=false",
            ],
        ),
        _cpu_step(
            "fp8_bf16_compile_false",
            "fp8",
            [
                "fp8_train",
                "model.preset=tiny",
                "train.strategy=single",
                "recipe=fp32",
                "train.steps=8",
                "fp8_debug.enabled=false",
            ],
        ),
        _cpu_step(
            "fp8_torchao_tensorwise_compile_false",
            "fp8",
            [
                "fp8_train",
                "model.preset=tiny",
                "train.steps=8",
                "train.strategy=single",
                "recipe=torchao_tensorwise",
                "fp8_debug.enabled=false",
            ],
        ),
        _cpu_step(
            "tp_attention",
            "tp",
            [
                "tp_attention",
                "train.tp=1",
                "train.sequence_parallel=false",
                "iters=2",
                "timing_warmup=1",
            ],
        ),
        _cpu_step(
            "allreduce_nccl",
            "allreduce",
            ["allreduce_bench", "collectives=[all_reduce]", "max_bytes=4K"],
        ),
    ]
    done = [run_step(s, tmp_path, deadline=time.monotonic() + 900) for s in run]
    for s in done:
        assert s.status == "ok" and s.data and not s.note, (s.name, s.status, s.note, s.tail)
    by = {s.name: s.data for s in done}
    assert (
        0 < by["mfu_single"]["mfu"] < 1
        and by["mfu_single"]["peak_flops_source"] == "measured cpu matmul probe"
    )
    for name in ("mfu_single", "fp8_bf16_compile_false", "fp8_torchao_tensorwise_compile_false"):
        losses = by[name]["losses"]  # every step's loss, read back from the run's records
        assert len(losses) == 8 and loss_falls(by[name]) is None, (name, losses)
    assert by["tp_attention"]["tp"] == 1 and by["tp_attention"]["single_s"] > 0
    assert by["allreduce_nccl"]["wrong_total"] == 0 and by["allreduce_nccl"]["cases"] > 0
    report = render(done, tmp_path)
    assert report.startswith("# gpu-check: unknown GPU") and "| mfu_single |" in report
    assert "torchao tensorwise FP8 vs bf16 at d_model 4096, compile=false: **" in report


def test_report_of_a_failed_and_a_skipped_step(tmp_path):
    failed = Step(
        "gemm_fp8", "FP8 GEMM", ["x"], 10, status="failed (exit 1)", tail="RuntimeError: boom"
    )
    skipped = Step(
        "gpu_tests",
        "pytest -m gpu",
        ["x"],
        10,
        kind="pytest",
        status="skipped",
        note="the 28-minute budget is spent",
    )
    text = render([failed, skipped], Path("results/gpu-check/x"))
    assert "| gemm_fp8 | FP8 GEMM | - | failed (exit 1) | 0 s |" in text
    assert "| gpu_tests | pytest -m gpu | the 28-minute budget is spent | skipped | 0 s |" in text
    assert "## gemm_fp8: failed (exit 1)" in text and "RuntimeError: boom" in text
    assert "## gpu_tests" not in text


def test_pytest_summary_line_is_parsed():
    from dtrain.gpucheck.check_step import _pytest

    assert _pytest("....\n5 passed, 2 skipped, 1 failed in 12.3s\n", Path(".")) == {
        "passed": 5,
        "skipped": 2,
        "failed": 1,
    }


def test_a_timed_out_step_takes_its_children_with_it(tmp_path):
    """A training step spawns ranks; a timeout must stop them too, or they hold the GPU."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    step = run_step(
        Step("spawner", "spawns", [sys.executable, "-c", code], limit_s=3),
        tmp_path,
        deadline=time.monotonic() + 100,
    )
    assert step.status == "timed out"
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"child {child} outlived the step")


def test_every_experiment_step_composes_with_its_typed_config(tmp_path):
    """A GPU session is rare: a renamed or mistyped key in a step must fail here, not on the GPU.
    Each step's overrides go through the same check the app runs before Hydra starts (renamed keys,
    unknown keys, wrong types); the device-dependent validation is left to the GPU."""
    from dtrain.run import precheck

    config_module = {
        "allreduce_bench": "allreduce_bench.conf",
        "fsdp_scaling": "fsdp_scaling.conf",
        "fp8_train": "fp8_train.conf",
        "tp_attention": "tp_attention.conf",
    }
    checked = []
    for step in steps(tmp_path):
        if (
            "-m" not in step.command
            or step.command[step.command.index("-m") + 1] not in config_module
        ):
            continue
        i = step.command.index("-m")
        module, argv = step.command[i + 1], step.command[i + 2 :] + [f"results_dir={tmp_path}"]
        precheck.check_overrides(
            config_module[module], "config", argv, None
        )  # raises UserError on a bad key
        checked.append(step.name)
    print("composed:", checked)
    assert len(checked) == 16 and {
        "fp8_scale_torchao_tensorwise",
        "eager_125m_32k",
        "allreduce_nccl",
        "mfu_zero3",
        "emulated_bf16",
        "tp_attention",
    } <= set(checked)


def test_step_profile_sums_gpu_time_and_launches_per_category():
    """The profiler's per-name rows: CUDA kernels summed by category (seconds from microseconds,
    launches from the row's count); CPU rows and kernels that took no device time are left out."""
    from types import SimpleNamespace as NS

    from dtrain.gpucheck.kernels import gpu_time_by_category

    cuda, cpu = NS(name="CUDA"), NS(name="CPU")
    rows = [
        NS(key="sm90_xmma_gemm_bf16", device_type=cuda, device_time_total=3000.0, count=12),
        NS(key="ampere_bf16_gemm", device_type=cuda, device_time_total=1000.0, count=4),
        NS(
            key="vectorized_elementwise_kernel",
            device_type=cuda,
            device_time_total=500.0,
            count=300,
        ),
        NS(key="multi_tensor_apply_kernel", device_type=cuda, device_time_total=0.0, count=9),
        NS(key="aten::mm", device_type=cpu, device_time_total=4000.0, count=16),
    ]
    seconds, launches = gpu_time_by_category(rows)
    assert seconds == pytest.approx({"gemm": 4e-3, "elementwise": 5e-4})
    assert launches == {"gemm": 16, "elementwise": 300}


def test_layer_probe_shard_counts_and_its_plan_price_on_cpu():
    """The probe's block holds one TP rank's shard: Llama 3.1 405B at TP8 has 16 query heads of
    128, one KV head and 6656 FFN columns, 16384·128·(2·16 + 2·1) + 3·16384·6656 = 398,458,880
    weights, 6 FLOPs per weight and token; the small CPU case runs forward+backward and carries
    the cost model's price of the same block (its `dtrain plan` command's compute terms less the
    head and the optimizer)."""
    import json as _json

    from dtrain.gpucheck.layer_probe import (
        LAYER_CASES,
        ShardBlock,
        layer_flops,
        layer_probe,
        model_price,
    )

    d, heads, kv, ffn, tp, b, s, _ = LAYER_CASES["llama3_405b_tp8"]
    fl = layer_flops(d, heads, kv, ffn, tp, b, s)
    assert fl["params"] == 16384 * 128 * (2 * 16 + 2 * 1) + 3 * 16384 * 6656 == 398_458_880
    assert fl["gemm"] == 6 * 398_458_880 * 2 * 8192
    assert fl["attention"] == 3.5 * 2 * 2 * 16 * 8192**2 * 128  # causal: half of 4·b·h·s²·d
    small = ShardBlock(256, 8, 4, 512, 2)
    assert (
        sum(p.numel() for p in small.parameters() if p.dim() == 2)
        == layer_flops(256, 8, 4, 512, 2, 1, 64)["params"]
    )
    [case] = layer_probe(small=True)["cases"]
    assert case["step_s"] > 0 and "error" not in case
    again = model_price(case["plan_command"])
    assert case["model"] == again and set(again["terms"]) == {
        "gemm",
        "attention",
        "memory",
        "recompute",
    }
    assert again["total"] == pytest.approx(sum(again["terms"].values()))
    assert _json.loads(_json.dumps(case)) == case  # what the report stores reads back


def test_probe_report_lines_and_contention_without_a_gpu():
    from dtrain.gpucheck.contention import contention
    from dtrain.gpucheck.report import layer_line, summarize

    if not __import__("torch").cuda.is_available():
        assert contention() == {
            "skipped": "contention needs a CUDA GPU (a side stream beside the compute)"
        }
    c = {
        "case": "llama3_8b",
        "precision": "fp8",
        "micro_batch": 2,
        "step_s": 0.0458,
        "model": {"total": 0.0458 / 1.1},
        "gpu_s_by_category": {"gemm": 0.0194, "elementwise": 0.0072},
    }
    assert (
        layer_line(c)
        == "llama3_8b fp8 mb 2: 45.8 ms, model 41.6 ms (measured 1.10x) (gemm 19.4, elementwise "
        "7.2 ms)"
    )
    assert (
        layer_line({"case": "x", "precision": "bf16", "error": "OutOfMemoryError: ..."})
        == "x bf16: OutOfMemoryError: ..."
    )
    step = Step(
        "contention",
        "c",
        [],
        1,
        data={
            "rows": [
                {
                    "victim": "gemm",
                    "aggressor": "sm_copy_16",
                    "sm_share": 0.121,
                    "hbm_share": 0.096,
                    "cost": 1.09,
                }
            ]
        },
    )
    assert (
        summarize(step)
        == "gemm with sm_copy_16 (12% of SMs, 10% of HBM): 1.09 of the transfer not hidden"
    )


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_probes_refuse_without_a_gpu_and_a_bad_micro_batch_list_in_one_line():
    cmd = [sys.executable, "-m", "dtrain.gpucheck.probes"]
    no_gpu = run_cmd([*cmd, "layer_probe", "--micro-batches", "1,2"])
    assert no_gpu.returncode == 2 and no_gpu.stderr.strip() == (
        "error: layer_probe needs a CUDA GPU (torch here sees none): run it on one, or pass "
        "--small for the CPU test sizes"
    )
    bad = run_cmd([*cmd, "layer_probe", "--small", "--micro-batches", "1,x"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "argument --micro-batches: '1,x' is not a comma-separated list of positive micro-batches "
        "(1,2,3)"
    )
    assert bad.stdout == ""
