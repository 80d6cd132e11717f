"""`python -m fp8_train inspect RUN [mse_bad=... underflow_bad_pct=...]`: rank the layers whose
tensors FP8 hurts most, from the debug tool's `fp8_debug` records, and suggest a fix for each.

Each (layer, tensor, recipe) gets a severity in [0, inf), >= 1 meaning "bad" by at least one
threshold (config `inspect:`, overridable on the command line):

    mse        log-scaled between mse_healthy (severity 0) and mse_bad (1)
    underflow  underflows_pct / underflow_bad_pct
    overflow   overflows_pct / overflow_bad_pct
    cosine     (1 - cos_sim) / (1 - cos_bad)

A layer's rank is its worst tensor under the run's own recipe (delayed for emulated_delayed,
current for the others); the other recipes' numbers decide the suggestion.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict

import pandas as pd

from dtrain.core.errors import UserError
from dtrain.results.loader import load, require_complete
from fp8_train.conf import InspectConfig

DEFAULTS = asdict(InspectConfig())  # the thresholds' defaults live in the config dataclass


def severity(row, t: dict) -> tuple[float, str]:
    """(severity, the criterion that set it)."""
    mse = max(row["mse"], 1e-300)
    parts = {
        "mse": math.log10(mse / t["mse_healthy"]) / math.log10(t["mse_bad"] / t["mse_healthy"]),
        "underflow": row["underflows_pct"] / t["underflow_bad_pct"],
        "overflow": row["overflows_pct"] / t["overflow_bad_pct"],
        "cosine": (1 - row["cos_sim"]) / (1 - t["cos_bad"]),
    }
    worst = max(parts, key=parts.get)
    return max(0.0, parts[worst]), worst


def own_recipe(run_recipe: str) -> str:
    return "delayed" if run_recipe.endswith("delayed") else "current"


def suggest(cause: str, tensor: str, recipe: str, others: dict[str, float], t: dict) -> str:
    better = [r for r, s in sorted(others.items(), key=lambda kv: kv[1]) if r != recipe and s < 1]
    if cause == "overflow" and recipe == "delayed" and "current" in better:
        return "use current scaling: the amax history lags this growing tensor"
    if cause == "underflow" and better:
        return f"try {better[0]} scaling (it underflows less here), or keep the layer in BF16"
    if better and any(r in ("mxfp8", "nvfp4", "mxfp4") for r in better):
        return (
            f"a block-scaled recipe ({better[0]}) fits this tensor's range; otherwise keep it in "
            "BF16"
        )
    if cause == "underflow" and tensor == "gradient":
        return "keep the layer in BF16 (gradients span more range than E5M2 at one scale)"
    return "keep the layer in BF16: 'precision_map.rules=[{pattern: <layer>, precision: high}]'"


def rank_layers(df: pd.DataFrame, run_recipe: str, t: dict) -> pd.DataFrame:
    agg = (
        df.groupby(["layer", "tensor", "recipe"])
        .agg(
            mse=("mse", "max"),
            rel_mse=("rel_mse", "max"),
            underflows_pct=("underflows_pct", "max"),
            overflows_pct=("overflows_pct", "max"),
            cos_sim=("cos_sim", "min"),
            samples=("step", "nunique"),
        )
        .reset_index()
    )
    sev = agg.apply(lambda r: severity(r, t), axis=1)
    agg["severity"], agg["cause"] = [s for s, _ in sev], [c for _, c in sev]
    mine = own_recipe(run_recipe)
    if mine not in set(agg["recipe"]):
        mine = agg["recipe"].iloc[0]
    rows = []
    for (layer, tensor), g in agg.groupby(["layer", "tensor"]):
        by_recipe = dict(zip(g["recipe"], g["severity"]))
        r = g[g["recipe"] == mine].iloc[0]
        verdict = "bad" if r.severity >= 1 else ("watch" if r.severity >= 0.5 else "healthy")
        fix = suggest(r.cause, tensor, mine, by_recipe, t) if verdict != "healthy" else "-"
        rows.append(
            {
                **r.to_dict(),
                "verdict": verdict,
                "suggestion": fix,
                **{f"severity_{k}": v for k, v in by_recipe.items()},
            }
        )
    out = pd.DataFrame(rows)
    worst = out.groupby("layer")["severity"].transform("max")
    return out.assign(layer_worst=worst).sort_values(["layer_worst", "severity"], ascending=False)


def thresholds(config: dict, overrides: list[str]) -> dict:
    t = {**DEFAULTS, **(config.get("inspect") or {})}
    for item in overrides:
        key, sep, value = item.removeprefix("inspect.").partition("=")
        if not sep or key not in DEFAULTS:
            raise UserError(
                f"inspect option {item!r}: expected key=value with key in {', '.join(DEFAULTS)}"
            )
        t[key] = float(value)
    return t


def main(argv: list[str]) -> pd.DataFrame:
    from rich.table import Table

    from dtrain.core.terminal import WIDTH, console

    if not argv:
        raise UserError(
            "usage: python -m fp8_train inspect RUN [mse_bad=1e3 underflow_bad_pct=80 ...]"
        )
    runs = require_complete([argv[0]], "inspect")
    if len(runs) != 1:
        raise UserError(f"{argv[0]} holds {len(runs)} complete runs: pass one run directory")
    run = runs[0]
    t = thresholds(run.config, argv[1:])
    df = load([run.path], kind="fp8_debug")
    if df.empty:
        raise UserError(f"{run.path} has no fp8_debug records: run with fp8_debug.enabled=true")
    ranked = rank_layers(df, run.config.get("recipe", ""), t)
    table = Table(
        title=f"FP8 debug: worst layers of {run.path.name} (recipe {run.config.get('recipe')})"
    )
    for col in (
        "layer",
        "tensor",
        "verdict",
        "cause",
        "mse",
        "underflow %",
        "overflow %",
        "cos",
        "suggestion",
    ):
        table.add_column(col)
    for r in ranked.head(int(t["top"]) * 3).itertuples():
        table.add_row(
            r.layer,
            r.tensor,
            r.verdict,
            r.cause,
            f"{r.mse:.2e}",
            f"{r.underflows_pct:.2f}",
            f"{r.overflows_pct:.3f}",
            f"{r.cos_sim:.5f}",
            r.suggestion,
        )
    console().print(table)  # within 100 columns: long names and suggestions wrap by words
    bad = sorted(set(ranked.loc[ranked.verdict == "bad", "layer"]))
    print(
        textwrap.fill(
            f"{len(bad)} layer(s) bad: {', '.join(bad) or 'none'}",
            WIDTH,
            break_on_hyphens=False,
            subsequent_indent="  ",
        )
    )
    print(
        f"thresholds: mse {t['mse_healthy']:g}..{t['mse_bad']:g}, "
        f"underflow {t['underflow_bad_pct']:g}%, overflow {t['overflow_bad_pct']:g}%, "
        f"cos {t['cos_bad']:g}"
    )
    return ranked
