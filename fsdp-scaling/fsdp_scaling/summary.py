"""After a run: the guide inputs (dtrain.results.contract), a table (measured vs formula bytes
side by side), CSV, plots."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from dtrain.core import terminal
from dtrain.results import contract_records, loader, plots, trainer_inputs
from dtrain.results.plots import human_bytes
from dtrain.train import TrainConfig

STATE_KEYS = ("params", "grads", "optimizer")
COMM_ELSEWHERE = " (TP, CP, PP comm: the step breakdown)"  # what the DP columns leave out


def headline(r: dict) -> dict:
    """A run's headline numbers, flat (tables, the study report): from the rank result or the
    summary."""
    ov = r.get("overlap") or {}
    return {
        "strategy": r["strategy"],
        "world_size": r["world_size"],
        "model_params": r["model_params"],
        "flops_per_token": r["flops_per_token"],
        "tokens_per_s": r["tokens_per_s"],
        "step_time_s": r["step_time_s"],
        "tflops_per_rank": r["tflops_per_rank"],
        "mfu": r["mfu"],
        "peak_flops": r["peak_flops"],
        "peak_flops_source": r["peak_flops_source"],
        "overlap_fraction": ov.get("overlap_fraction"),
        "comm_s": ov.get("comm_s"),
        "exposed_comm_s": ov.get("exposed_comm_s"),
        "peak_mem_bytes": r["peak_mem_bytes"],
        "state_bytes": dict(r["state_bytes"]),
        "state_bytes_formula": dict(r["state_bytes_formula"]),
        "mixed_precision": r["mixed_precision"],
        "device": r["device"],
        "backend": r["backend"],
        "tp": r.get("tp", 1),
        "pp": r.get("pp", 1),
        "dp": r.get("dp", r["world_size"]),
        "cp": r.get("cp", 1),
        "ep": r.get("ep", 1),
        "pp_schedule": r.get("pp_schedule"),
        "breakdown": r.get("breakdown"),
    }


def print_tables(r: dict, console: Console | None = None) -> None:
    console = console or terminal.console()
    g = headline(r)
    cp = f" x cp{g['cp']} ({r.get('cp_impl')})" if g["cp"] > 1 else ""
    cp += f" x ep{g['ep']}" if g["ep"] > 1 else ""
    layout = (
        f" dp{g['dp']} x tp{g['tp']} x pp{g['pp']}{cp}"
        if g["tp"] * g["pp"] * g["cp"] * g["ep"] > 1
        else ""
    )
    t = Table(
        title=f"fsdp-scaling: {g['strategy']}{layout} on {g['world_size']} rank(s), "
        f"{g['device']}/{g['backend']}",
        caption=f"s = seconds per step; DP = the data-parallel gradient sync{COMM_ELSEWHERE}",
    )
    for col in (
        "tokens/s",
        "step s",
        "TFLOP/s/rank",
        "MFU",
        "DP comm s",
        "DP exposed s",
        "DP hidden",
        "peak mem",
    ):
        t.add_column(col, justify="right")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    t.add_row(
        fmt(g["tokens_per_s"], ".0f"),
        fmt(g["step_time_s"], ".4f"),
        fmt(g["tflops_per_rank"], ".4f"),
        fmt(g["mfu"], ".1%"),
        fmt(g["comm_s"], ".4f"),
        fmt(g["exposed_comm_s"], ".4f"),
        fmt(g["overlap_fraction"], ".0%"),
        human_bytes(g["peak_mem_bytes"]),
    )
    console.print(t)
    m = Table(
        title=f"state bytes on rank 0 (shard degree {r['shard_degree']})",
        caption="measured vs the ZeRO formula",
    )
    for col in ("", "measured", "formula", "ideal Psi/S", "match"):
        m.add_column(col, justify="right")
    for k in STATE_KEYS:
        meas, form, ideal = (
            r["state_bytes"].get(k),
            r["state_bytes_formula"][k],
            r["state_bytes_ideal"][k],
        )
        m.add_row(k, str(meas), str(form), str(ideal), "yes" if meas == form else "NO")
    console.print(m)
    console.print(f"peak FLOP/s per rank: {g['peak_flops']:.3g} ({g['peak_flops_source']})")
    b = g["breakdown"]
    if b:
        whole = f"dp{g['dp']} x tp{g['tp']} x pp{g['pp']}{cp}"  # every dimension, cp included
        bt = Table(title=f"step breakdown on rank 0, {whole} (profiled steps, s/step)")
        cols = {
            "step": "step_s",
            "compute": "compute_s",
            "TP comm": "tp_comm_s",
            "CP comm": "cp_comm_s",
            "EP a2a": "ep_comm_s",
            "PP p2p": "pp_p2p_s",
            "DP comm": "dp_comm_s",
            "DP exposed": "dp_comm_exposed_s",
            "idle / bubble": "idle_s",
        }
        if g["ep"] == 1:  # the column only where expert parallelism ran
            del cols["EP a2a"]
        for col in cols:
            bt.add_column(col, justify="right")
        bt.add_row(*(format(b.get(k, 0.0), ".4f") for k in cols.values()))
        console.print(bt)
    if r.get("moe_overload_mean") is not None:
        console.print(
            f"MoE: overload factor {r['moe_overload_mean']:.3f} mean, {r['moe_overload_max']:.3f} "
            f"max (busiest {'ep rank' if g['ep'] > 1 else 'expert'} / balanced); dropped "
            f"{r['moe_dropped_frac_mean']:.1%} of assignments"
        )


def plot_steps(run_dir: Path) -> Path | None:
    df = (
        loader.load([run_dir], kind="step", warn=False)
        if (run_dir / "summary.json").exists()
        else None
    )
    if df is None or df.empty:
        import pandas as pd

        df = pd.DataFrame(loader.read_jsonl(run_dir / "records.jsonl"))
        df = df[df["kind"] == "step"]
    fig, axes = plots.figure(ncols=2)
    axes[0][0].plot(df["step"], df["loss"], marker="o")
    axes[0][0].set(xlabel="step", ylabel="loss", title="training loss")
    axes[0][1].plot(df["step"], df["step_time_s"], marker="o")
    axes[0][1].set(
        xlabel="step", ylabel="step time (s)", title="step time (incl. warmup / profiled)"
    )
    plots.integer_axis(axes[0][0]), plots.integer_axis(axes[0][1])
    return plots.save(fig, run_dir / "steps.png")


def finalize(run_dir: Path, cfg: DictConfig, result: dict) -> dict:
    import csv

    run_dir = Path(run_dir)
    print_tables(result)
    with open(run_dir / "state_bytes.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "measured", "formula", "ideal"])
        for k in STATE_KEYS:
            w.writerow(
                [
                    k,
                    result["state_bytes"].get(k),
                    result["state_bytes_formula"][k],
                    result["state_bytes_ideal"][k],
                ]
            )
    plot_steps(run_dir)
    where = contract_records.where_of(result["device"], result["backend"], result["gpu_name"])
    layout = TrainConfig(**result["train"]).layout(result["world_size"], where.device)
    inputs = trainer_inputs.training_inputs(
        result,
        result["model"],
        layout,
        where,
        overlap=result.get("overlap"),
        breakdown=result.get("breakdown"),
    )
    if result["model"].get("moe"):  # its own record only: dense calibration never reads it
        inputs = trainer_inputs.moe_inputs(
            result, result["model"], layout, where, result.get("breakdown")
        )
    return {
        **{k: v for k, v in result.items() if k not in ("model", "train")},
        "seq_len": result["model"]["seq_len"],
        "guide_inputs": inputs,
    }
