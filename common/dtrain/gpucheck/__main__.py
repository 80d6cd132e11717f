"""`make gpu-check` (scripts/gpu-check runs `python -m dtrain.gpucheck`): on one GPU, the `gpu`
tests and a fixed list of measurements, each a subprocess with its own time limit inside a 28-minute
budget, then one markdown report, printed and written to results/gpu-check/<time>/report.md
(report.json beside it; every training run's own run directory under runs/).

What one GPU can show (../shared/gpu/README.md): GEMM and copy ceilings, bf16 MFU single and FSDP2
with one rank, FP8 (torchao) against bf16 with and without torch.compile, the emulated FP8 recipe
under bf16, TP attention at tp=1, NCCL correctness with one rank, a published block at its TP shard
against the cost model (`probes.layer_probe`), the cost of a transfer beside compute
(`probes.contention`). No bus bandwidth or scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from dtrain.gpucheck.report import Step, loss_falls, plot_losses, render

BUDGET_S = 28 * 60
# Training steps that must learn: a learning rate for widths 768-4096 with a warm-up of a few
# steps (the trainer's default 3e-3 with 2 warm-up steps, tuned for the tiny CPU models, made
# the first checks' loss rise from 11.2 to 13.4); report.loss_falls fails a step whose loss
# did not fall.
LEARN = ["train.lr=3e-4", "train.min_lr=3e-5", "train.warmup_steps=6"]
QUIET_FP8 = [
    "fp8_debug.enabled=false",
    "health.enabled=false",
    "guard.enabled=false",
    "train.log_every=0",
]


def steps(runs: Path) -> list[Step]:
    """(name, what, command, time limit); {runs} is filled per step with its results folder."""
    m = [sys.executable, "-m", "dtrain.gpucheck.measure"]
    k = [sys.executable, "-m", "dtrain.gpucheck.kernels"]
    sp = [sys.executable, "-m", "dtrain.gpucheck.stepprof"]
    pr = [sys.executable, "-m", "dtrain.gpucheck.probes"]
    one_gpu = ["world_size=1", "device=cuda"]
    mfu = [
        "-m",
        "fsdp_scaling",
        *one_gpu,
        "model.preset=1b",
        "model.n_layer=8",
        "train.precision=bf16",
        "train.micro_batch=8",
        "train.steps=30",
        "train.timing_warmup=6",
        "profile.enabled=false",
        *LEARN,
    ]
    fp8_4096 = [
        "-m",
        "fp8_train",
        *one_gpu,
        "train.strategy=single",
        "model.preset=7b",
        "model.n_layer=4",
        "train.micro_batch=2",
        "train.steps=30",
        "train.timing_warmup=6",
        *LEARN,
        *QUIET_FP8,
    ]
    # FP8 where GEMMs dominate (issue 42): the same d_model 4096 model compiled, 4 micro-batches
    # of 2 x 2048 a step, so the fp32 AdamW step is a small share; 100 steps for both loss curves
    fp8_scale = [
        *(a for a in fp8_4096 if not a.startswith(("train.steps=", "train.timing_warmup="))),
        "train.grad_accum=4",
        "train.compile=true",
        "train.steps=100",
        "train.timing_warmup=10",
    ]
    # the eager trainer (FSDP2 zero3 on one rank, no compile) at the small-model and long-sequence
    # end, for the cost model's eager stack (issue 39): `dtrain backtest --measured` scores them
    eager = [
        "-m",
        "fsdp_scaling",
        *one_gpu,
        "train.strategy=zero3",
        "train.precision=bf16",
        "profile.enabled=false",
        "train.timing_warmup=6",
        *LEARN,
    ]
    eager_runs = [
        ("eager_125m_2k", "125m", [], 2048, 8, 30),
        ("eager_125m_8k", "125m", [], 8192, 2, 30),
        ("eager_125m_32k", "125m", [], 32768, 1, 20),
        ("eager_1b8l_8k", "1b", ["model.n_layer=8"], 8192, 2, 20),
        ("eager_1b8l_16k", "1b", ["model.n_layer=8"], 16384, 1, 20),
    ]
    py = [sys.executable]
    out = [
        Step("env", "the machine", [*m, "env"], 120),
        Step("copy", "device-to-device copy, 1 GiB, read + write bytes", [*m, "copy"], 120),
        Step("gemm_bf16", "bf16 GEMM 8192^3", [*m, "gemm_bf16"], 150),
        Step(
            "gemm_fp8",
            "FP8 GEMM 8192^3 (torch._scaled_mm, E4M3 x E4M3 -> bf16)",
            [*m, "gemm_fp8"],
            150,
        ),
        Step(
            "gemm_sweep",
            "bf16 / FP8 GEMM TFLOP/s over LLM training shapes",
            [*k, "gemm_sweep"],
            240,
        ),
        Step(
            "attention_sweep",
            "SDPA fwd / fwd+bwd TFLOP/s by backend, head dim, sequence",
            [*k, "attention_sweep"],
            240,
        ),
        Step(
            "membound",
            "memory-bound kernels (norms, SwiGLU, cross-entropy, AdamW) vs copy",
            [*k, "membound"],
            180,
        ),
        Step(
            "step_profile",
            "GPU time per kernel category of one GPT training step (profiler)",
            [*sp, "step_profile"],
            240,
        ),
        Step(
            "eager_sweep",
            "the eager step at 125M-1B and 2K-32K tokens and torchao FP8 at 7B/4 layers: host "
            "issue time, each phase's host and GPU time, kernels, GPU busy and idle gaps, peak "
            "memory; foreach vs fused AdamW",
            [*sp, "eager_sweep"],
            300,
        ),
        Step(
            "grouped_gemm",
            "MoE expert GEMM: torch._grouped_mm vs a per-expert loop vs dense, by tokens per "
            "expert (bf16; FP8 row-wise on Hopper)",
            [sys.executable, "-m", "dtrain.gpucheck.grouped"],
            180,
        ),
        Step(
            "layer_probe",
            "one published block at its TP shard (Llama 3.1 405B TP8, 8B), bf16 / FP8, compiled, "
            "full AC, against the cost model's price on this GPU",
            [*pr, "layer_probe"],
            420,
        ),
        Step(
            "contention",
            "GEMMs, adds and a Llama block beside an SM copy kernel of C blocks or PCIe copies: "
            "the share of the transfer the overlap did not hide",
            [*pr, "contention"],
            180,
        ),
        Step(
            "allreduce_nccl",
            "allreduce-bench over NCCL, one rank (correctness only)",
            [
                *py,
                "-m",
                "allreduce_bench",
                *one_gpu,
                "backend=nccl",
                "collectives=[all_reduce,all_gather,reduce_scatter,broadcast]",
                "max_bytes=64M",
                "dtypes=[float32,bfloat16]",
            ],
            240,
            kind="allreduce",
        ),
        Step(
            "mfu_single",
            "bf16 MFU, 1B-class GPT (d 2048, 8 layers), single",
            [*py, *mfu, "train.strategy=single"],
            300,
            kind="fsdp",
        ),
        Step(
            "mfu_zero3",
            "bf16 MFU, same model, FSDP2 zero3 on one rank",
            [*py, *mfu, "train.strategy=zero3"],
            300,
            kind="fsdp",
        ),
        Step(
            "emulated_bf16",
            "emulated FP8 (delayed) under bf16, 125M GPT",
            [
                *py,
                "-m",
                "fp8_train",
                *one_gpu,
                "train.strategy=single",
                "recipe=emulated_delayed",
                "train.precision=bf16",
                "model.preset=125m",
                "train.steps=30",
                "train.micro_batch=8",
                *QUIET_FP8,
            ],
            240,
            kind="fp8",
        ),
    ]
    for compiled in ("false", "true"):
        for recipe in ("bf16", "torchao_tensorwise"):
            out.append(
                Step(
                    f"fp8_{recipe}_compile_{compiled}",
                    f"d_model 4096 (7B shape, 4 layers): {recipe}, compile={compiled}",
                    [*py, *fp8_4096, f"recipe={recipe}", f"train.compile={compiled}"],
                    240,
                    kind="fp8",
                )
            )
    for recipe in ("bf16", "torchao_tensorwise"):
        out.append(
            Step(
                f"fp8_scale_{recipe}",
                f"d_model 4096 (7B shape, 4 layers), compiled, grad_accum 4, 100 steps: {recipe}",
                [*py, *fp8_scale, f"recipe={recipe}"],
                300,
                kind="fp8",
            )
        )
    for name, preset, over, seq, mb, n in eager_runs:
        out.append(
            Step(
                name,
                f"eager trainer, FSDP2 zero3 on one rank: {preset} {' '.join(over)} seq {seq}, "
                f"mb {mb}",
                [
                    *py,
                    *eager,
                    f"model.preset={preset}",
                    *over,
                    f"model.seq_len={seq}",
                    f"train.micro_batch={mb}",
                    f"train.steps={n}",
                ],
                240,
                kind="fsdp",
            )
        )
    out += [
        Step(
            "tp_attention",
            "TP attention block at tp=1 (bf16, b 4, s 2048, d 2048)",
            [
                *py,
                "-m",
                "tp_attention",
                *one_gpu,
                "train.tp=1",
                "train.precision=bf16",
                "train.sequence_parallel=false",
                "train.micro_batch=4",
                "model.seq_len=2048",
                "model.d_model=2048",
                "model.n_head=16",
            ],
            240,
            kind="tp",
        ),
        # the cost model's GPU compute calibration: the training runs above, their GEMMs timed on
        # this GPU
        Step(
            "gemm_probe",
            "gemm-probe over this check's training runs (the GPU calibration)",
            [*py, "-m", "dtrain.costmodel.gemm_probe", str(runs / "runs")],
            300,
            kind="probe",
        ),
        Step(
            "gpu_tests",
            "pytest -m gpu",
            [*py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts="],
            420,
            kind="pytest",
        ),
    ]
    return out


def run_step(step: Step, run_dir: Path, deadline: float) -> Step:
    left = deadline - time.monotonic()
    if left < 30:
        step.status, step.note = "skipped", "the time budget (--budget-s) is spent"
        return step
    folder = run_dir / "runs" / step.name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = step.command + (
        [f"results_dir={folder}"] if step.kind in ("fsdp", "fp8", "tp", "allreduce") else []
    )
    limit = min(step.limit_s, left)
    t0 = time.monotonic()
    # its own process group: on timeout the spawned ranks go too, and free the GPU for the next step
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        step.status, step.note = "timed out", f"stopped after {limit:.0f} s"
    else:
        step.status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    step.seconds = time.monotonic() - t0
    step.tail = (stdout + stderr)[-2000:]
    (folder / "output.txt").write_text(stdout + "\n--- stderr ---\n" + stderr)
    if step.status == "ok":
        step.collect(stdout, folder)
        why = loss_falls(step.data) if step.kind in ("fsdp", "fp8") else None
        if why:  # a training step that does not learn proves nothing about speed or numerics
            step.status, step.note = "failed (loss)", why
    return step


def write_report(done: list[Step], run_dir: Path) -> str:
    report = render(done, run_dir)
    (run_dir / "report.md").write_text(report)
    (run_dir / "report.json").write_text(
        json.dumps([s.to_dict() for s in done], indent=1, default=str)
    )
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck")
    p.add_argument(
        "--results", default="results", help="the report goes to RESULTS/gpu-check/<time>/"
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated step names, run in that order (default: all, in the listed order)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue an earlier check in RUN_DIR: run the steps not yet ok, one report for all",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="stop starting steps after this many seconds",
    )
    args = p.parse_args(argv)
    names = [s.name for s in steps(Path(args.results))]
    # the order asked for (default: the listed one): a short lease measures what matters most first
    wanted = args.only.split(",") if args.only is not None else names
    unknown = [w for w in wanted if w not in names]
    if unknown:  # before the GPU is asked for and before any folder is made
        print(
            f"error: --only names no step {', '.join(unknown)}: pick from {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "error: make gpu-check needs a CUDA GPU, and torch here sees none "
            "(torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "report.json").is_file():
            print(
                f"error: {run_dir} holds no report.json of an earlier gpu-check: pass the folder "
                "it printed",
                file=sys.stderr,
            )
            return 2
        done = [Step(**d) for d in json.loads((run_dir / "report.json").read_text())]
    else:
        run_dir = Path(args.results) / "gpu-check" / datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir.mkdir(parents=True)
        done = []
    deadline = time.monotonic() + args.budget_s
    ok = {s.name for s in done if s.status == "ok"}
    done = [s for s in done if s.status == "ok"]
    todo = sorted(
        (s for s in steps(run_dir) if s.name in wanted and s.name not in ok),
        key=lambda s: wanted.index(s.name),
    )
    report = write_report(done, run_dir)
    for step in todo:
        print(f"gpu-check: {step.name} ({step.what}) ...", file=sys.stderr, flush=True)
        done.append(run_step(step, run_dir, deadline))
        print(
            f"gpu-check: {step.name}: {step.status} in {step.seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        # after every step, so a check stopped from outside still leaves what it measured
        report = write_report(done, run_dir)
    print(report)
    print(f"report written to {run_dir / 'report.md'}", file=sys.stderr)
    try:
        plot = plot_losses(done, run_dir / "losses.png")
        if plot:
            print(f"loss curves written to {plot}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - a missing plotting library costs the plot only
        print(f"gpu-check: no loss plot ({type(e).__name__}: {e})", file=sys.stderr)
    return 0 if all(s.status == "ok" for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
