"""After all ranks finished: the table, the CSV, the plot and the summary (with the guide's inputs).

    overhead_factor = step_time * tp / single_rank_step_time    (1.0 = perfect TP scaling)

where single_rank_step_time is the unsharded layer on one rank's resources (one GPU; on CPU one
rank's threads). The issue's CPU targets compare against DTensor and against one process with the
whole TP group's threads.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from dtrain.results import contract_records, plots
from tp_attention.config import model_config

TARGET_VS_DTENSOR = 0.75  # hand-rolled / DTensor step time at tp = 2
TARGET_VS_SAME_THREADS = 1.3  # hand-rolled tp = 2 / one process with the same total threads


def _ratio(a, b):
    return None if a is None or not b else a / b


def guide_inputs(cfg, entries: list[dict], result: dict) -> list[contract_records.TpMeasurement]:
    """One dtrain.results.contract_records.TpMeasurement per (tp, SP) entry: exactly what the cost
    model reads."""
    m = model_config(cfg)
    where = contract_records.where_of(result["device"], result["backend"], result.get("gpu_name"))
    return [
        contract_records.TpMeasurement(
            module=cfg.module,
            tp=e["tp"],
            sequence_parallel=e["sequence_parallel"],
            micro_batch=cfg.train.micro_batch,
            seq_len=m.seq_len,
            d_model=m.d_model,
            n_head=m.n_head,
            n_kv_head=m.n_kv_head or m.n_head,
            mlp_ratio=int(m.mlp_ratio),
            precision=str(cfg.train.precision),
            step_time_s=e["handrolled_s"],
            single_rank_step_time_s=e["single_s"],
            comm_share=e["comm_share"],
            comm_bytes_per_layer=int(e["comm_bytes_per_layer"]),
            overhead_factor=e["handrolled_s"] * e["tp"] / e["single_s"],
            where=where,
            dtensor_step_time_s=e["dtensor_s"],
        )
        for e in entries
    ]


def targets(entries: list[dict]) -> list[dict]:
    out = []
    for e in entries:
        if e["tp"] != 2:
            continue
        vs_dt = _ratio(e["handrolled_s"], e["dtensor_s"])
        vs_st = _ratio(e["handrolled_s"], e["single_same_threads_s"])
        out.append(
            {
                "sequence_parallel": e["sequence_parallel"],
                "handrolled_over_dtensor": vs_dt,
                "target_over_dtensor": TARGET_VS_DTENSOR,
                "met_over_dtensor": None if vs_dt is None else vs_dt <= TARGET_VS_DTENSOR,
                "handrolled_over_same_threads": vs_st,
                "target_over_same_threads": TARGET_VS_SAME_THREADS,
                "met_over_same_threads": None if vs_st is None else vs_st <= TARGET_VS_SAME_THREADS,
            }
        )
    return out


def _ms(s):
    return "-" if s is None else f"{s * 1e3:.1f}"


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "missed"


def target_lines(t: dict) -> list[str]:
    """One line per target of `targets`, saying whether it was met:
    `target at tp=2, SP=off: hand/DTensor 1.02 <= 0.75 missed`."""
    at = f"target at tp=2, SP={'on' if t['sequence_parallel'] else 'off'}:"
    return [
        f"{at} {name} {_x(t[f'handrolled_over_{key}'])} <= {t[f'target_over_{key}']} "
        f"{verdict(t[f'met_over_{key}'])}"
        for name, key in (("hand/DTensor", "dtensor"), ("hand/same-threads", "same_threads"))
    ]


def _x(r):
    return "-" if r is None else f"{r:.2f}"


# (header, what it means): the headers stay short so the table fits dtrain.core.terminal.WIDTH
# columns; the legend printed under it spells them out
COLUMNS = (
    ("tp", ""),
    ("SP", "sequence parallel"),
    ("hand", "hand-rolled"),
    ("async", "hand-rolled, async comm"),
    ("DTensor", ""),
    ("single", "one rank, unsharded"),
    ("same-thr", "one rank with tp x threads"),
    ("hand/DT", ""),
    ("hand/same", ""),
    ("overhead", "hand x tp / single"),
    ("comm", "share of hand's step"),
    ("KiB", "comm per layer"),
)


def print_table(df: pd.DataFrame, title: str) -> None:
    from dtrain.core.terminal import print_table as show

    rows = [
        [
            str(r.tp),
            "on" if r.sequence_parallel else "off",
            _ms(r.handrolled_s),
            _ms(r.handrolled_async_s),
            _ms(r.dtensor_s),
            _ms(r.single_s),
            _ms(r.single_same_threads_s),
            _x(_ratio(r.handrolled_s, r.dtensor_s)),
            _x(_ratio(r.handrolled_s, r.single_same_threads_s)),
            _x(r.overhead_factor),
            f"{r.comm_share:.1%}",
            f"{r.comm_bytes_per_layer / 1024:.0f}",
        ]
        for _, r in df.iterrows()
    ]
    show(title, COLUMNS, rows, note="step times in ms per layer (forward + backward, median)")


def plot(df: pd.DataFrame, path: Path, title: str) -> Path:
    impls = {
        "handrolled_s": "hand-rolled",
        "handrolled_async_s": "hand-rolled async",
        "dtensor_s": "DTensor",
        "single_s": "single rank",
        "single_same_threads_s": "single, tp x threads",
    }
    long = df.melt(
        id_vars=["tp", "sequence_parallel"],
        value_vars=[c for c in impls if c in df],
        var_name="impl",
        value_name="s",
    ).dropna()
    long["impl"] = long["impl"].map(impls)
    long["ms"] = long["s"] * 1e3
    long["setting"] = long.apply(
        lambda r: f"tp={r.tp} SP={'on' if r.sequence_parallel else 'off'}", axis=1
    )
    import seaborn as sns

    fig, axes = plots.figure(ncols=2, width=7.2)
    sns.barplot(long, x="setting", y="ms", hue="impl", ax=axes[0][0])
    axes[0][0].set(title="forward+backward per layer", xlabel="", ylabel="ms (median)")
    sns.move_legend(
        axes[0][0], "upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, title=None, frameon=False
    )
    sns.lineplot(
        df, x="tp", y="overhead_factor", hue="sequence_parallel", marker="o", ax=axes[0][1]
    )
    axes[0][1].axhline(1.0, color="grey", ls="--", lw=1)
    axes[0][1].set_xticks(sorted(set(df.tp)))
    axes[0][1].set(
        title="TP overhead factor (1 = perfect)",
        ylabel="step time x tp / single rank",
        ylim=(0, None),
    )
    plots.legend_outside(axes[0][1], "sequence parallel")
    fig.suptitle(title)
    return plots.save(fig, path)


def finalize(run_dir: Path, cfg, result: dict) -> dict:
    entries = result["entries"]
    df = pd.DataFrame(entries)
    df["overhead_factor"] = df.handrolled_s * df.tp / df.single_s
    m = model_config(cfg)
    title = (
        f"tp-attention {cfg.module}: b={cfg.train.micro_batch} s={m.seq_len} d={m.d_model} "
        f"heads={m.n_head}/{m.n_kv_head} {cfg.train.precision} on {result['device']} "
        f"({result['backend']})"
    )
    print_table(df, title)
    df.drop(columns=["op_counts", "dtensor_collectives"]).to_csv(
        Path(run_dir) / "tp_overhead.csv", index=False
    )
    plot(df, Path(run_dir) / "tp_step_time.png", title)
    checked = targets(entries)
    for t in checked:
        for line in target_lines(t):
            print(line)
    return {
        "device": result["device"],
        "backend": result["backend"],
        "gpu_name": result.get("gpu_name"),
        "threads_per_rank": result["threads_per_rank"],
        "guide_inputs": guide_inputs(cfg, entries, result),
        "targets": checked,
        "entries": entries,
    }
