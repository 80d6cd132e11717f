"""The app's three parts: validate (before any rank), rank_fn (every rank), finalize (after them).

Ranks: topology report (rank 0), then the sweep (sweep.py). After them, `finalize` prints the
nccl-tests table and the fits, writes the CSV and plots, and returns the summary whose
`guide_inputs` (dtrain.results.contract_records.CollectiveFit, one per intra/inter-node fit) the
parallelism guide reads.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch
from omegaconf import DictConfig

from allreduce_bench import groups, report, spec, sweep, topology_report
from dtrain.core.terminal import WIDTH
from dtrain.results import contract_records
from dtrain.results.metrics import ENV
from dtrain.run.rank import RankContext

GUIDE_FIT_KEYS = (
    "collective",
    "link_class",
    "alpha_us",
    "beta_GBps",
    "r2",
    "n_points",
    "algo_factor",
    "dtype",
    "world_size",
    "theoretical_GBps",
    "beta_pct_of_theoretical",
)


def rank_fn(ctx: RankContext) -> dict:
    """The sweep's result; on rank 0 also the node's topology facts (TOPOLOGY.md is written
    here)."""
    s = spec.parse(ctx.cfg)
    facts = None
    if ctx.is_main:
        gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
        facts = topology_report.write(ctx.run_dir, ctx.hosts, gpu)
    plan_hosts = (
        groups.simulated_hosts(ctx.world_size, s.simulate_nodes) if s.simulate_nodes else ctx.hosts
    )
    result = sweep.run(ctx, s, plan_hosts)
    return {**result, "topology": facts} if ctx.is_main else result


def finalize(run_dir: Path, cfg: DictConfig, result: dict) -> dict:
    df = report.load_records(run_dir)
    print(report.nccl_table(df), flush=True)
    env = json.loads((run_dir / ENV).read_text())  # the launcher's facts: device, backend, GPUs
    topo = result.get("topology") or {}
    theoretical = dict(topo.get("theoretical_GBps") or {"intra_node": None, "inter_node": None})
    if result.get("simulated_nodes"):  # pretend hosts share one box: no datasheet link applies
        theoretical["inter_node"] = None
    theoretical["world"] = (
        theoretical["inter_node"] if "world" in set(df.link_class) else theoretical["intra_node"]
    )
    fitted, unfitted = report.fits(df, theoretical)
    report.print_fits(fitted)
    for u in unfitted:  # wrapped by words: within 100 columns for any collective and link
        said = f"no fit for {u['collective']} ({u['link_class']}, {u['dtype']}): {u['reason']}"
        print(textwrap.fill(said, WIDTH, subsequent_indent="  "), flush=True)
    csv = run_dir / report.CSV
    df.drop(columns=["kind"]).to_csv(csv, index=False)
    print(f"wrote table {csv}", flush=True)
    plots = [
        report.plot_busbw(df, run_dir / report.BUSBW_PLOT),
        report.plot_fits(df, fitted, run_dir / report.FIT_PLOT),
    ]
    device = "cuda" if str(env.get("device", "cpu")).startswith("cuda") else "cpu"
    gpus = env.get("gpus") or []
    peak = report.peak_busbw(df)
    gpu_name = gpus[0]["name"] if gpus else None
    where = contract_records.where_of(device, env.get("backend"), gpu_name)
    inputs = [
        contract_records.CollectiveFit(**{k: f[k] for k in GUIDE_FIT_KEYS}, where=where)
        for f in fitted
        if f["link_class"] in ("intra_node", "inter_node")
    ]  # the world fits are not a link
    # the run's folder is printed last (run complete: ...): a path here would overflow 100 columns
    print(
        f"the links behind these numbers: {topology_report.REPORT} in the run's folder", flush=True
    )
    return {
        "guide_inputs": inputs,
        "topology": topo,
        "device": device,
        "backend": env.get("backend"),
        "gpu_name": gpu_name,
        "world_size": env.get("world_size"),
        "fits": fitted,
        "unfitted": unfitted,
        "peak_busbw_GBps": peak,
        "theoretical_GBps": theoretical,
        "topology_source": topo.get("source"),
        "num_hosts": result["num_hosts"],
        "simulated_nodes": result.get("simulated_nodes"),
        "link_classes": result["link_classes"],
        "link_classes_not_measured": result["not_measured"],
        "skipped": result["skipped"],
        **({"alltoallv": result["alltoallv"]} if "alltoallv" in result else {}),
        "cases": len(df),
        "wrong_total": int(df["wrong"].fillna(0).sum()),
        "files": {
            "csv": csv.name,
            "plots": [p.name for p in plots],
            "topology": topology_report.REPORT,
        },
    }
