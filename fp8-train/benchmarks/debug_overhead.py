"""Debug-tool overhead: mean step time with the FP8 debug tool sampling every N steps vs off.

    flock /tmp/dtrain-bench.lock python fp8-train/benchmarks/debug_overhead.py [--preset small] [--reps 2]

Runs `python -m fp8_train` alternately with debug.enabled=false and debug.freq=N (same seed, so
the same data and weights), `reps` times each, and compares the MEAN step time after warmup (the
median would hide the one-in-N sampled steps). Writes a run-style folder with overhead.json and
prints a table. Target: overhead <= 5% at freq=10.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from dtrain.results import load


def run(out: Path, tag: str, overrides: list[str]) -> Path:
    target = out / tag
    cmd = [sys.executable, "-m", "fp8_train", f"hydra.run.dir={target}", f"results_dir={out}",
           "health.tensorboard=false", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return target


def mean_step(run_dir: Path) -> float:
    df = load([run_dir], kind="step")
    warm = "warmup_step" if "warmup_step" in df else "timing_warmup"  # the Trainer's flag for warmup steps
    df = df[~df[warm].astype(bool)]
    return float(df["step_time_s"].mean())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--freq", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="results/fp8-train-bench")
    args = p.parse_args()
    out = Path(args.out) / f"debug-overhead-{datetime.now():%Y%m%d-%H%M%S}"
    base = [f"model.preset={args.preset}", f"train.steps={args.steps}", "train.log_every=0"]
    times = {"off": [], "on": []}
    for rep in range(args.reps):
        times["off"].append(mean_step(run(out, f"off-{rep}", base + ["debug.enabled=false"])))
        times["on"].append(mean_step(run(out, f"on-{rep}", base + [f"debug.freq={args.freq}"])))
    off, on = statistics.fmean(times["off"]), statistics.fmean(times["on"])
    result = {"preset": args.preset, "steps": args.steps, "freq": args.freq, "reps": args.reps,
              "mean_step_s_off": off, "mean_step_s_on": on, "overhead_pct": 100 * (on / off - 1),
              "samples": times, "machine": "2-core shared CPU, 2 gloo ranks (ddp)"}
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    print(f"debug tool overhead, {args.preset}, freq={args.freq}: off {off * 1e3:.1f} ms/step, "
          f"on {on * 1e3:.1f} ms/step -> {result['overhead_pct']:+.1f}%   ({out / 'overhead.json'})")


if __name__ == "__main__":
    main()
