"""Debug-tool overhead: step time with the FP8 debug tool off, tracking amaxes only, and sampling
every `--freq` steps (the default selection: every linear, 3 tensors, delayed + current).

    flock /tmp/dtrain-bench.lock python fp8-train/benchmarks/debug_overhead.py [--preset small
    --micro-batch 2]

One process, one thread, the shared Trainer (strategy single, emulated_delayed): the three
configurations are built side by side and timed in alternating rounds of `--freq` steps (one
sampled step per round), so machine noise (a shared 2-core box) hits all three alike. Two
estimates of each configuration's step time: the best round (mean step time of the fastest round)
and the per-step minimum (for each of the round's step positions the fastest over rounds, then
the mean; noise from another job is one-sided, so both take minima). A multi-rank run adds the
same per-rank work (stats are computed on rank 0 only). Writes JSON to --out and prints a table.
Target: <= 5% at freq=10.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dtrain.model.gpt import GPTConfig
from dtrain.results.metrics import RunWriter
from dtrain.run.dist import DistEnv
from dtrain.run.rank import RankContext
from dtrain.train import TrainConfig, Trainer
from fp8_train import backends
from fp8_train.conf import Fp8DebugConfig
from fp8_train.debug import DebugTool

FP8 = OmegaConf.create(
    {"margin": 0, "amax_history_len": 16, "amax_compute_algo": "max", "e5m2_overflow": "saturate"}
)


def make(args, freq: int, enabled: bool) -> Trainer:
    tmp = Path(tempfile.mkdtemp(prefix="fp8-dbg-bench-"))
    ctx = RankContext(
        OmegaConf.create({"seed": 0}),
        DistEnv(0, 1, 0, 1, "127.0.0.1", 0),
        torch.device("cpu"),
        "gloo",
        tmp,
        RunWriter(tmp),
    )
    debug = OmegaConf.structured(
        Fp8DebugConfig(
            enabled=enabled,
            freq=freq,
            margin=0,
            amax_history_len=16,
            e5m2_overflow="saturate",
            sample_elements=args.sample_elements,
        )
    )
    train = TrainConfig(
        steps=10**6,
        micro_batch=args.micro_batch,
        strategy="single",
        dataset_tokens=100_000,
        log_every=0,
    )
    t = Trainer(
        ctx,
        train,
        GPTConfig.from_preset(args.preset),
        callbacks=[DebugTool(debug, tmp, 0)],
        linear_factory=backends.emulated_linear("emulated_delayed", FP8),
        peak_flops=(1e12, "unused"),
    )
    t._call("on_train_start")
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--freq", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sample-elements", type=int, default=4096)
    p.add_argument("--out", default="results/fp8-train-bench")
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = {
        "off": make(args, args.freq, False),
        "track_only": make(args, 10**9, True),
        f"freq_{args.freq}": make(args, args.freq, True),
    }
    steps: dict[str, list[list[float]]] = {k: [] for k in cases}  # [round][position] seconds
    for _ in range(args.rounds):
        for name, trainer in cases.items():
            times = []
            for _ in range(args.freq):
                t0 = time.perf_counter()
                trainer.train_step()
                times.append(time.perf_counter() - t0)
            steps[name].append(times)
    best = {k: min(sum(r) / len(r) for r in v) for k, v in steps.items()}
    per_step = {k: sum(min(col) for col in zip(*v)) / args.freq for k, v in steps.items()}
    result = {
        "preset": args.preset,
        "micro_batch": args.micro_batch,
        "freq": args.freq,
        "rounds": args.rounds,
        "sample_elements": args.sample_elements,
        "step_s": steps,
        "best_round_s_per_step": best,
        "per_step_min_s_per_step": per_step,
        "overhead_pct": {k: 100 * (v / best["off"] - 1) for k, v in best.items()},
        "overhead_pct_per_step_min": {
            k: 100 * (v / per_step["off"] - 1) for k, v in per_step.items()
        },
        "machine": "shared 2-core CPU, 1 thread",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"debug-overhead-{args.preset}-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{'':6s} {'':12s} {'best round':>19s}  {'per-step min':>19s}")
    for k, v in best.items():
        print(
            f"{args.preset:6s} {k:12s} {v * 1e3:7.1f} ms {result['overhead_pct'][k]:+6.1f}%"
            f"  {per_step[k] * 1e3:7.1f} ms {result['overhead_pct_per_step_min'][k]:+6.1f}%"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
