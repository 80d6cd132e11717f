"""After the CP study's ranks finished: the table, the CSV, the plot and the summary (guide inputs).

overhead = step_time * cp / single_device_step_time    (1.0 = perfect: cp ranks, 1/cp of the work
                                                       each)
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from dtrain.parallel.feasibility import OWN_CP_IMPLS
from dtrain.results import contract_records, plots
from dtrain.results.plots import human_bytes
from tp_attention.cp.bench import model_at

LABELS = {
    "single": "one device",
    "ring": "ring",
    "ulysses": "all-to-all (Ulysses)",
    "tp_sp": "TP + SP",
}


def guide_inputs(cfg, rows: list[dict], result: dict) -> list[contract_records.CpMeasurement]:
    """One dtrain.results.contract_records.CpMeasurement per (seq_len, cp, impl) of this package's
    CP."""
    where = contract_records.where_of(result["device"], result["backend"], result.get("gpu_name"))
    single = {r["seq_len"]: r["median_s"] for r in rows if r["impl"] == "single"}
    tp_sp = {(r["seq_len"], r["cp"]): r["median_s"] for r in rows if r["impl"] == "tp_sp"}
    out = []
    for r in rows:
        if r["impl"] not in OWN_CP_IMPLS:  # not the baselines (single, tp_sp)
            continue
        m = model_at(cfg, r["seq_len"])
        out.append(
            contract_records.CpMeasurement(
                impl=r["impl"],
                cp=r["cp"],
                seq_len=r["seq_len"],
                micro_batch=cfg.train.micro_batch,
                d_model=m.d_model,
                n_head=m.n_head,
                n_kv_head=m.n_kv_head,
                precision=str(cfg.train.precision),
                step_time_s=r["median_s"],
                single_device_step_time_s=single[r["seq_len"]],
                comm_bytes_per_layer=int(r["comm_bytes_per_layer"]),
                saved_bytes=int(r["saved_bytes"]),
                where=where,
                serial_step_time_s=r.get("serial_s"),
                overlap_fraction=r.get("overlap_fraction"),
                tp_sp_step_time_s=tp_sp.get((r["seq_len"], r["cp"])),
            )
        )
    return out


def frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    single = df[df.impl == "single"].set_index("seq_len").median_s
    df["overhead"] = df.median_s * df.cp / df.seq_len.map(single)
    return df.sort_values(["seq_len", "cp", "impl"]).reset_index(drop=True)


# (header, what it means): short headers keep the table within dtrain.core.terminal.WIDTH columns;
# the legend printed under it spells them out
COLUMNS = (
    ("seq", "sequence length"),
    ("cp", ""),
    ("impl", ""),
    ("ms", "step time per layer"),
    ("overhead", "ms x cp / one device"),
    ("serial", "ring ms, sends not overlapped"),
    ("sends", "ms of the ring's sends alone"),
    ("overlap", "share of sends hidden by compute"),
    ("KiB", "comm per layer"),
    ("saved", "bytes kept for backward per rank"),
)


def print_table(df: pd.DataFrame, title: str) -> None:
    from dtrain.core.terminal import print_table as show

    opt = lambda v, f: "-" if v is None or v != v else format(v, f)  # noqa: E731  (None / NaN)
    rows = [
        [
            str(r.seq_len),
            str(r.cp),
            LABELS[r.impl],
            f"{r.median_s * 1e3:.1f}",
            f"{r.overhead:.2f}",
            opt(_ms(r.get("serial_s")), ".1f"),
            opt(_ms(r.get("sends_s")), ".1f"),
            opt(r.get("overlap_fraction"), ".0%"),
            opt(_kib(r.get("comm_bytes_per_layer")), ".0f"),
            human_bytes(r.saved_bytes),
        ]
        for _, r in df.iterrows()
    ]
    show(title, COLUMNS, rows, left=("impl",))


def _ms(s):
    return None if s is None or s != s else s * 1e3


def _kib(n):
    return None if n is None or n != n else n / 1024


def plot(df: pd.DataFrame, path: Path, title: str) -> Path:
    import seaborn as sns

    long = df.assign(
        ms=df.median_s * 1e3,
        MiB=df.saved_bytes / 2**20,
        layout=[
            LABELS[i] + ("" if i == "single" else f", {c} ranks") for i, c in zip(df.impl, df.cp)
        ],
    )
    fig, axes = plots.figure(ncols=2, width=5.2)
    time_ax, mem_ax = axes[0]
    sns.lineplot(long, x="seq_len", y="ms", hue="layout", marker="o", ax=time_ax, legend=False)
    time_ax.set(
        title="forward+backward of one attention layer",
        xlabel="sequence length",
        ylabel="ms (median)",
    )
    sns.lineplot(long, x="seq_len", y="MiB", hue="layout", marker="o", ax=mem_ax)
    mem_ax.set(
        title="activations kept for backward, per rank", xlabel="sequence length", ylabel="MiB"
    )
    for ax in (time_ax, mem_ax):
        plots.log_axis_plain(ax, "x")
        plots.log_axis_plain(ax, "y")
    plots.legend_outside(mem_ax)
    fig.suptitle(title)
    return plots.save(fig, path)


def finalize(run_dir: Path, cfg, result: dict) -> dict:
    df = frame(result["rows"])
    m = model_at(cfg, int(df.seq_len.iloc[0]))
    title = (
        f"tp-attention cp: b={cfg.train.micro_batch} d={m.d_model} heads={m.n_head}/{m.n_kv_head} "
        f"{cfg.train.precision} on {result['device']} ({result['backend']})"
    )
    print_table(df, title)
    df.to_csv(Path(run_dir) / "cp_scaling.csv", index=False)
    plot(df, Path(run_dir) / "cp_scaling.png", title)
    return {
        "device": result["device"],
        "backend": result["backend"],
        "gpu_name": result.get("gpu_name"),
        "threads_per_rank": result["threads_per_rank"],
        "guide_inputs": guide_inputs(cfg, result["rows"], result),
        "rows": result["rows"],
    }
