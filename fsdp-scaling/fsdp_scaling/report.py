"""`python -m fsdp_scaling.report RUN_DIRS... [--out DIR]`: the scaling study over many runs.

Loads complete runs through dtrain.results.loader (single runs or Hydra multirun trees), then writes
into one report directory (a derived run, dtrain.results.derived: config.yaml, env.json,
summary.json naming
the runs it was made from in "derived_from"):

  scaling.csv                    one row per run: strategy, layout (tpNxppM[xcpK]), ranks, tokens/s,
                                 MFU, efficiency, vs-DDP ratio, step breakdown (compute, TP, CP, PP,
                                 DP, idle)
  throughput_vs_ranks.png        tokens/s against world size, per strategy
  efficiency.png                 scaling efficiency against world size
  memory_per_strategy.png        measured parameter + gradient + optimizer bytes per rank
  overlap.png                    overlapped vs exposed DP communication per step
  summary.json["study"]          {"runs": [per-run headline numbers], "scaling_efficiency": {...}}

Scaling efficiency at N ranks, within a group of runs that differ only in world size
(same strategy, tp x pp layout, model, sequence length, precision, and either the same global batch
= strong scaling, or the same per-rank batch = weak scaling), against the group's smallest world
size N0:

    efficiency(N) = (tokens_per_s(N) / N) / (tokens_per_s(N0) / N0)

1.0 is perfect; strong and weak scaling share the formula because in both the ideal throughput
grows linearly with N (strong: same work per step split N ways; weak: N times the work per step).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from dtrain.core.errors import UserError
from dtrain.core.layout import SHARDED
from dtrain.results import derived, loader, plots
from dtrain.results.derived import write_derived_run
from fsdp_scaling.summary import headline

GROUP = [
    "strategy",
    "layout",
    "scaling",
    "model",
    "seq_len",
    "batch",
    "mixed_precision",
    "prefetch",
    "ac",
]
BREAKDOWN = (
    "compute_s",
    "tp_comm_s",
    "cp_comm_s",
    "pp_p2p_s",
    "dp_comm_exposed_s",
    "idle_s",
)  # overlap.step_breakdown


def layout_name(g: dict) -> str:
    """`tp2xpp1`, with `xcp<N>` when the run splits sequences (a cp run never looks like its
    cp=1 twin)."""
    cp = g.get("cp", 1) or 1
    return f"tp{g.get('tp', 1)}xpp{g.get('pp', 1)}" + (f"xcp{cp}" if cp > 1 else "")


def study_frame(paths) -> tuple[pd.DataFrame, list[dict]]:
    runs = [
        r for r in loader.complete_runs(paths) if r.subproject == "fsdp-scaling" and not r.derived
    ]
    if not runs:
        raise UserError(
            f"no complete fsdp-scaling training runs under {', '.join(map(str, paths))}: "
            "run `python -m fsdp_scaling -m ...` first"
        )
    rows, heads = [], []
    for run in runs:
        g, cfg = headline(run.summary), run.config
        t, m = cfg.get("train", {}), cfg.get("model", {})
        strong = t.get("global_batch") is not None
        rows.append(
            {
                **{
                    k: g[k]
                    for k in (
                        "strategy",
                        "world_size",
                        "tokens_per_s",
                        "step_time_s",
                        "mfu",
                        "tflops_per_rank",
                        "overlap_fraction",
                        "comm_s",
                        "exposed_comm_s",
                        "peak_mem_bytes",
                        "mixed_precision",
                        "peak_flops_source",
                    )
                },
                "scaling": "strong" if strong else "weak",
                "batch": t.get("global_batch") if strong else t.get("micro_batch"),
                "model": m.get("preset"),
                "seq_len": m.get("seq_len") or run.summary.get("seq_len"),
                "prefetch": bool(t.get("prefetch")),
                "ac": t.get("activation_checkpointing"),
                "state_bytes": sum(g["state_bytes"].values()),
                "run": str(run.path),
                "layout": layout_name(g),
                **{k: (g.get("breakdown") or {}).get(k) for k in BREAKDOWN},
            }
        )
        heads.append({**g, "run": str(run.path)})
    df = pd.DataFrame(rows)
    df["seq_len"] = df["seq_len"].fillna(-1)
    return add_efficiency(df), heads


def add_efficiency(df: pd.DataFrame) -> pd.DataFrame:
    """efficiency vs the smallest world size of each group; step-time ratio vs DDP at the same
    point."""
    df = df.copy()
    per_rank = df["tokens_per_s"] / df["world_size"]
    base = df.loc[
        df.groupby(GROUP, dropna=False)["world_size"].transform("idxmin"), "tokens_per_s"
    ].to_numpy()
    base_ranks = df.groupby(GROUP, dropna=False)["world_size"].transform("min").to_numpy()
    df["efficiency"] = per_rank / (base / base_ranks)
    point = [c for c in GROUP if c not in ("strategy", "prefetch")] + [
        "world_size"
    ]  # ddp of the same layout
    ddp = (
        df[df["strategy"] == "ddp"]
        .groupby(point, dropna=False)["step_time_s"]
        .median()
        .rename("ddp_step_time_s")
    )
    df = df.join(ddp, on=point)
    df["step_time_vs_ddp"] = df["step_time_s"] / df["ddp_step_time_s"]
    return df.drop(columns="ddp_step_time_s")


def label(df: pd.DataFrame) -> pd.Series:
    """strategy (+prefetch where FSDP2 prefetches: sharded strategies only), layout, scaling."""
    layout = df["layout"].where(df["layout"] != "tp1xpp1", "").map(lambda x: f" {x}" if x else "")
    prefetch = (df["prefetch"] & df["strategy"].isin(SHARDED)).map({True: "+prefetch", False: ""})
    return df["strategy"] + prefetch + layout + " (" + df["scaling"] + ")"


def _bars(df: pd.DataFrame, y: str, ylabel: str, title: str, path: Path) -> Path:
    """One bar per series at each world size: every run is visible, however few ranks each series
    has."""
    import seaborn as sns

    fig, ax = plots.figure(width=6.4, height=4.0)
    sns.barplot(df, x="world_size", y=y, hue="series", errorbar=None, ax=ax[0][0])
    ax[0][0].set(xlabel="ranks", ylabel=ylabel, title=title)
    plots.legend_outside(ax[0][0], "strategy, layout (scaling)")
    return plots.save(fig, path)


def write_plots(df: pd.DataFrame, out: Path) -> list[Path]:
    import seaborn as sns

    df = df.assign(series=label(df) + " " + df["model"].astype(str)).sort_values(
        ["world_size", "series"]
    )
    paths = [
        _bars(
            df,
            "tokens_per_s",
            "tokens/s (all ranks)",
            "throughput",
            out / "throughput_vs_ranks.png",
        ),
        _bars(
            df,
            "efficiency",
            "scaling efficiency (1 = linear)",
            "per-rank throughput vs the series' fewest ranks",
            out / "efficiency.png",
        ),
    ]
    fig, ax = plots.figure(width=6.4, height=4.0)
    mem = df.assign(state_mib=df["state_bytes"] / 2**20, ranks=df["world_size"].astype(str))
    sns.barplot(
        mem,
        x="strategy",
        y="state_mib",
        hue="ranks",
        errorbar=None,
        palette="colorblind",
        ax=ax[0][0],
    )
    ax[0][0].set(
        ylabel="params + grads + optimizer per rank (MiB)", title="state memory per rank"
    )  # linear axis
    plots.legend_outside(ax[0][0], "ranks")
    paths.append(plots.save(fig, out / "memory_per_strategy.png"))
    ov = df.dropna(subset=["comm_s"]).copy()
    if not ov.empty:
        ov["overlapped_ms"] = (ov["comm_s"] - ov["exposed_comm_s"]) * 1e3
        ov["exposed_ms"] = ov["exposed_comm_s"] * 1e3
        ov["point"] = label(ov) + " x" + ov["world_size"].astype(str)
        fig, ax = plots.figure(width=7)
        ax[0][0].barh(ov["point"], ov["overlapped_ms"], label="overlapped")
        ax[0][0].barh(ov["point"], ov["exposed_ms"], left=ov["overlapped_ms"], label="exposed")
        ax[0][0].set(
            xlabel="DP communication per step (ms)",
            title="data-parallel communication hidden behind compute",
        )
        plots.legend_outside(ax[0][0])
        paths.append(plots.save(fig, out / "overlap.png"))
    return paths


def scaling_summary(df: pd.DataFrame) -> dict:
    """{series: {"world_size": [...], "efficiency": [...], "tokens_per_s": [...], ...}} for the
    guide."""
    out = {}
    for key, g in (
        df.assign(series=label(df)).sort_values("world_size").groupby(["series", "model"])
    ):
        out[f"{key[0]} {key[1]}"] = {
            c: g[c].tolist()
            for c in (
                "world_size",
                "tokens_per_s",
                "efficiency",
                "mfu",
                "overlap_fraction",
                "step_time_vs_ddp",
            )
        }
    return out


# (header, column, format, what it means): the printed table keeps to dtrain.core.terminal.WIDTH
# columns, the legend under it says what the short headers mean; scaling.csv has every column
PRINTED = (
    ("dp", "strategy", "", "DP strategy"),
    ("layout", "layout", "", ""),
    ("scaling", "scaling", "", ""),
    ("model", "model", "", ""),
    ("ranks", "world_size", "", ""),
    ("tok/s", "tokens_per_s", ".0f", ""),
    ("step s", "step_time_s", ".4f", ""),
    ("MFU", "mfu", ".1%", ""),
    ("eff", "efficiency", ".2f", "scaling efficiency"),
    ("/ddp", "step_time_vs_ddp", ".2f", "step time / DDP's"),
    ("hidden", "overlap_fraction", ".0%", "share of DP comm hidden by compute"),
    ("exp s", "exposed_comm_s", ".4f", "DP comm s/step not hidden"),
    ("mem", "peak_mem_bytes", "", "peak memory"),
)


def _cell(value, fmt: str, col: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if col == "peak_mem_bytes":
        return plots.human_bytes(value)
    return format(value, fmt) if fmt else str(value)


def print_study(table: pd.DataFrame) -> None:
    from dtrain.core.terminal import print_table

    text = {h for h, col, fmt, _ in PRINTED if not fmt and col != "world_size"}
    rows = [[_cell(r.get(c), fmt, c) for _, c, fmt, _ in PRINTED] for _, r in table.iterrows()]
    print_table("fsdp-scaling study", [(h, m) for h, _, _, m in PRINTED], rows, left=text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_scaling.report", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "paths", nargs="+", help="run directories or folders above them (multirun trees)"
    )
    p.add_argument(
        "--out", help="report directory, new or empty (default results/fsdp-scaling/report-<time>)"
    )
    args = p.parse_args(argv)
    try:
        if args.out:  # before the runs are read: a folder it may not write costs one line
            derived.check_output(args.out)
        df, heads = study_frame(args.paths)
        # a derived run owns its folder as a run does (.run-owner); the default name never collides
        out = (
            derived.claim_output(args.out)
            if args.out
            else derived.claim_fresh("results/fsdp-scaling", "report-")
        )
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cols = [
        "strategy",
        "layout",
        "scaling",
        "model",
        "seq_len",
        "batch",
        "prefetch",
        "world_size",
        "tokens_per_s",
        "step_time_s",
        "mfu",
        "efficiency",
        "step_time_vs_ddp",
        "overlap_fraction",
        "exposed_comm_s",
        *BREAKDOWN,
        "state_bytes",
        "peak_mem_bytes",
        "peak_flops_source",
        "run",
    ]
    table = df[cols].sort_values(
        ["scaling", "model", "strategy", "layout", "prefetch", "world_size"]
    )
    table.to_csv(out / "scaling.csv", index=False)
    print_study(table)
    print(f"wrote {out / 'scaling.csv'} (every column, the step breakdown included)")
    write_plots(df, out)
    # a derived run: it names its runs, which keep their own guide inputs (nothing is published
    # twice)
    write_derived_run(
        out,
        "fsdp-scaling",
        [h["run"] for h in heads],
        {"report": True, "inputs": [str(p) for p in args.paths]},
        {"runs": len(heads), "study": {"runs": heads, "scaling_efficiency": scaling_summary(df)}},
    )
    print(f"report complete: {out}  (summary.json written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
