"""`python -m fp8_train compare [--recipes a,b] [--seeds 0,1,2] [--noise-k 2] [hydra overrides]`

Trains the high-precision baseline and each FP8 recipe over several seeds (a Hydra multirun of
`python -m fp8_train` underneath, so `hydra/launcher=submitit_slurm` sends it to Slurm), then
writes a derived run directory results/fp8-train/compare-<time>/ (dtrain.results.derived: it names
the sweep's runs under runs/) with report.md, plots, and one
dtrain.results.contract_records.Fp8Comparison per recipe in its summary's "guide_inputs", which the
cost model reads.

The within-noise test, stated: a recipe is within noise when its mean final loss (mean of the
last 5 steps, averaged over seeds) lies in the baseline's seed band, |mean_r - mean_b| <=
k * std_b (k = --noise-k, default 2; std over the baseline's seeds). The report also gives the
difference in units of the standard error of the difference, for readers who prefer a t-like number.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import torch

from dtrain.core.checks import one_of
from dtrain.core.errors import UserError
from dtrain.core.terminal import WIDTH, shell_command
from dtrain.results import contract_records, plots
from dtrain.results.derived import claim_fresh, write_derived_run
from dtrain.results.loader import complete_runs, load, load_events, load_runs
from dtrain.results.metrics import SUMMARY, write_json_atomic
from fp8_train.recipes import HIGH, RECIPES

CPU_RECIPES = ["fp32", "emulated_delayed", "emulated_current", "torchao_tensorwise"]
GPU_RECIPES = ["bf16", "te_delayed", "te_current", "torchao_tensorwise", "torchao_rowwise"]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m fp8_train compare", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--recipes",
        help="comma list; the first high-precision one is the baseline "
        f"(default: {','.join(CPU_RECIPES)} on CPU, {','.join(GPU_RECIPES)} on GPU)",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default 0,1,2)")
    p.add_argument(
        "--noise-k", type=float, default=2.0, help="within noise: |mean_r - mean_b| <= k * std_b"
    )
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(
            f"compare: unexpected argument {bad[0]!r}: options are --recipes, --seeds, --noise-k, "
            "and hydra overrides key=value"
        )
    return args, overrides


def plan(args, overrides: list[str]) -> tuple[list[str], str, list[int]]:
    on_gpu = torch.cuda.is_available() and "device=cpu" not in overrides
    recipes = args.recipes.split(",") if args.recipes else (GPU_RECIPES if on_gpu else CPU_RECIPES)
    for r in recipes:
        one_of("compare: --recipes", r, RECIPES)
    baseline = next((r for r in recipes if r in HIGH and r != "fp16"), None)
    if baseline is None:
        raise UserError(
            "compare: --recipes needs a high-precision baseline (fp32 or bf16) among them"
        )
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise UserError(
            f"compare: --seeds={args.seeds!r} must be a comma list of integers"
        ) from None
    if len(seeds) < 2:
        raise UserError("compare: a seed-noise band needs at least 2 seeds (--seeds 0,1,2)")
    return recipes, baseline, seeds


def aggregate(runs: pd.DataFrame, baseline: str, k: float) -> dict:
    """Per recipe: final loss mean/std over seeds, speed-up and memory factor vs the baseline."""
    by = runs.groupby("recipe")
    if baseline not in by.groups:
        raise UserError(f"compare: no complete {baseline} run to compare against")
    b = by.get_group(baseline)
    b_mean, b_std = b["summary.final_loss"].mean(), b["summary.final_loss"].std(ddof=1)
    b_tps, b_mem = b["summary.tokens_per_s"].mean(), b["summary.peak_mem_bytes"].mean()
    out = {}
    for recipe, g in by:
        mean, std = g["summary.final_loss"].mean(), g["summary.final_loss"].std(ddof=1)
        se = math.sqrt((b_std**2) / len(b) + (std**2) / len(g)) if len(g) > 1 else float("nan")
        out[recipe] = {
            "speedup": float(g["summary.tokens_per_s"].mean() / b_tps),
            "memory_factor": float(g["summary.peak_mem_bytes"].mean() / b_mem),
            "final_loss_mean": float(mean),
            "final_loss_std": float(std),
            "within_noise": bool(abs(mean - b_mean) <= k * b_std),
            "diff_in_se": float(abs(mean - b_mean) / se) if se and se > 0 else None,
            "tokens_per_s": float(g["summary.tokens_per_s"].mean()),
            "peak_mem_bytes": float(g["summary.peak_mem_bytes"].mean()),
            "seeds": int(len(g)),
            "nan_events": int(g["summary.nan_events"].sum()),
        }
    return out


def plot_curves(steps: pd.DataFrame, baseline: str, k: float, out: Path) -> Path:
    fig, axes = plots.figure(ncols=2, width=6.4, height=4.2)
    ax = axes[0][0]
    steps = steps.dropna(subset=["loss"]).drop_duplicates(["run", "step"], keep="last")
    for recipe, g in steps.groupby("recipe", sort=False):
        curve = g.groupby("step")["loss"].agg(["mean", "std"])
        ax.plot(curve.index, curve["mean"], label=recipe, linewidth=1.3)
        if recipe == baseline:
            ax.fill_between(
                curve.index,
                curve["mean"] - k * curve["std"],
                curve["mean"] + k * curve["std"],
                alpha=0.25,
                label=f"{baseline} ±{k:g}σ (seeds)",
            )
    ax.set(
        xlabel="step", ylabel="loss (mean over seeds)", title="loss curves and the seed-noise band"
    )
    plots.integer_axis(ax)
    ax = axes[0][1]
    tail = steps[steps["step"] > steps["step"].max() * 0.75]
    for recipe, g in tail.groupby("recipe", sort=False):
        curve = g.groupby("step")["loss"].mean()
        ax.plot(curve.index, curve.values, label=recipe, marker=".")
    ax.set(xlabel="step", ylabel="loss (mean over seeds)", title="last quarter, zoomed")
    plots.integer_axis(ax)
    handles, labels = axes[0][
        0
    ].get_legend_handles_labels()  # the band's entry is on the first panel
    plots.legend_outside(ax, "recipe", handles=handles, labels=labels)
    return plots.save(fig, out)


def report(
    out_dir: Path,
    recipes: dict,
    baseline: str,
    k: float,
    events: pd.DataFrame,
    keep: list[str],
    device: str,
    figures: list[str],
) -> str:
    lines = [
        f"# FP8 comparison: {', '.join(r for r in recipes if r != baseline)} vs {baseline}",
        "",
        f"Device: {device}. Final loss = mean of the last 5 steps, then mean ± std over seeds.",
        f"Within noise: |mean_r - mean_{baseline}| <= {k:g} x std_{baseline} (the baseline's seed "
        "band).",
        "",
        "| recipe | final loss | tokens/s | speed-up | memory factor | within noise | diff / SE | "
        "NaN |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sorted(recipes.items(), key=lambda kv: kv[0] != baseline):
        se = f"{r['diff_in_se']:.2f}" if r["diff_in_se"] is not None else "-"
        lines.append(
            f"| {name} | {r['final_loss_mean']:.4f} ± {r['final_loss_std']:.4f} | "
            f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['memory_factor']:.2f} | "
            f"{'yes' if r['within_noise'] else 'NO'} | {se} | {r['nan_events']} |"
        )
    verdict = [n for n, r in recipes.items() if n != baseline and not r["within_noise"]]
    lines += [
        "",
        "**Verdict:** "
        + (
            "every recipe trains within the baseline's seed noise."
            if not verdict
            else f"outside the noise band: {', '.join(verdict)}."
        ),
        "",
        f"Layers kept in high precision by the FP8 runs: {', '.join(keep) or 'none'}.",
        "",
    ]
    if device == "cpu":
        lines += [
            "On CPU every FP8 recipe is emulated (fake quantization around fp32 GEMMs; torchao "
            "with emulate=True), so speed-ups only measure emulation overhead plus machine noise, "
            "and peak memory is the process RSS: neither predicts a GPU.",
            "",
        ]
    lines += ["## NaN / recovery events", ""]
    if events.empty:
        lines.append("None.")
    else:
        for e in events.itertuples():
            lines.append(
                f"- {e.recipe} seed {e.seed}: step {e.step} {e.kind} "
                f"{getattr(e, 'action', '') or ''}"
            )
    lines += ["", "## Plots", ""] + [f"![{f}]({f})" for f in figures]
    # prose wrapped by words (markdown joins the lines again), so the printed report fits 100
    # columns
    return (
        "\n".join(
            w
            for line in lines
            for w in (
                [line]
                if line.startswith("|")
                else textwrap.wrap(line, WIDTH, break_on_hyphens=False) or [""]
            )
        )
        + "\n"
    )


def main(argv: list[str]) -> dict:
    args, overrides = parse(argv)
    recipes, baseline, seeds = plan(args, overrides)
    results_dir = next(
        (o.split("=", 1)[1] for o in overrides if o.startswith("results_dir=")), "results"
    )
    overrides = [o for o in overrides if not o.startswith(("results_dir=", "recipe=", "seed="))]
    # a derived run's own new folder, claimed before the sweep (dtrain.results.derived); its runs go
    # inside it
    out = claim_fresh(Path(results_dir) / "fp8-train", "compare-", "results_dir", holds_runs=True)
    plan_config = {
        "mode": "compare",
        "recipes": recipes,
        "baseline": baseline,
        "seeds": seeds,
        "noise_k": args.noise_k,
        "overrides": overrides,
    }
    cmd = [
        sys.executable,
        "-m",
        "fp8_train",
        "-m",
        f"recipe={','.join(recipes)}",
        f"seed={','.join(map(str, seeds))}",
        f"results_dir={out / 'runs'}",
        *overrides,
    ]
    print(f"compare: {len(recipes) * len(seeds)} runs -> {out}\n{shell_command(cmd)}", flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True) if proc.returncode == 2 else None
        raise UserError(f"compare: the sweep failed (exit {proc.returncode}); see the output above")
    runs = load_runs([out / "runs"])
    agg = aggregate(runs, baseline, args.noise_k)
    steps = load([out / "runs"], kind="step")
    figures = [plot_curves(steps, baseline, args.noise_k, out / "loss_curves.png").name]
    events = load_events([out / "runs"], warn=False)
    if not events.empty:
        events = events[events["kind"].isin(["nonfinite", "recovery", "fp16_overflow"])]
    keep = sorted(
        {
            layer
            for layers in runs.loc[~runs["recipe"].isin(HIGH), "summary.high_precision_layers"]
            for layer in (layers or [])
        }
    )
    device = str(runs["summary.device"].iloc[0])
    (out / "report.md").write_text(
        report(out, agg, baseline, args.noise_k, events, keep, device, figures)
    )
    backend = str(runs["summary.backend"].iloc[0])
    gpu = next((n for n in runs.get("summary.gpu_name", []) if isinstance(n, str)), None)
    where = contract_records.where_of(device, backend, gpu)
    # "emulated": the speed-up is emulation overhead, not FP8 hardware (every FP8 recipe on CPU)
    fp8 = [
        contract_records.Fp8Comparison(
            recipe=k,
            baseline=baseline,
            speedup=v["speedup"],
            memory_factor=v["memory_factor"],
            within_noise=v["within_noise"],
            emulated=k.startswith("emulated") or device == "cpu",
            final_loss_mean=v["final_loss_mean"],
            final_loss_std=v["final_loss_std"],
            seeds=v["seeds"],
            keep_high_precision=keep,
            where=where,
        )
        for k, v in agg.items()
        if k != baseline
    ]
    write_json_atomic(out / "compare.json", agg)
    sources = sorted(r.path for r in complete_runs([out / "runs"], warn=False))
    summary = {
        "mode": "compare",
        "results": agg,
        "device": device,
        "backend": backend,
        "baseline": baseline,
        "keep_high_precision": keep,
        "nan_events": int(sum(v["nan_events"] for v in agg.values())),
    }
    write_derived_run(
        out, "fp8-train", sources, config=plan_config, summary=summary, guide_inputs=fp8
    )
    print((out / "report.md").read_text())
    print(f"compare complete: {out}  (report.md, summary.json written)")
    return read_summary(out)


def read_summary(out: Path) -> dict:
    import json

    return json.loads((out / SUMMARY).read_text())
