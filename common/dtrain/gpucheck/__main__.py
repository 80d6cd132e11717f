"""`make gpu-check` (scripts/gpu-check runs `python -m dtrain.gpucheck`): on one GPU, the `gpu`
tests and a fixed list of measurements (dtrain.gpucheck.step_list), each a subprocess with its own
time limit inside a 28-minute budget, then one markdown report, printed and written to
results/gpu-check/<time>/report.md (report.json beside it; every training run's own run directory
under runs/). This module runs the steps: --only, --resume, the budget, one step's process.
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
from dtrain.gpucheck.step_list import steps

BUDGET_S = 28 * 60


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
