"""`dtrain runs [PATHS]`: what runs are there, and which are complete.

Runs launched on Slurm also show their job id, its state (sacct), node list and log folder; Slurm
jobs that left no complete run (a failed sweep point, a crashed or cancelled job) are listed
below with the last lines of their error (dtrain/slurm_runs.py).
"""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dtrain import slurm_runs
from dtrain.results import find_runs


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list run directories and their status")
    p.add_argument("paths", nargs="*", default=["results"], help="run dirs or folders above them (default: results)")
    p.add_argument("--all", action="store_true", help="also list incomplete and corrupt runs")
    p.set_defaults(func=run)


def run(args) -> int:
    runs = find_runs(args.paths)
    jobs = slurm_runs.jobs_in(args.paths)
    states = {j.job: j for j in jobs}
    on_slurm = any(r.env.get("slurm_job") or r.env.get("slurm_job_id") for r in runs) or bool(jobs)
    table = Table(title=f"{len(runs)} run(s) under {', '.join(args.paths)}")
    cols = ["subproject", "status", "world", "backend", "device", "created", "path"]
    if on_slurm:
        cols += ["slurm job", "state", "nodes", "logs"]
    for col in cols:
        table.add_column(col)
    shown = 0
    for r in runs:
        if r.status != "complete" and not args.all:
            continue
        shown += 1
        style = {"complete": "green", "incomplete": "yellow", "corrupt": "red"}[r.status]
        row = [r.subproject, f"[{style}]{r.status}[/]" + (f" ({r.reason})" if r.reason else ""),
               str(r.env.get("world_size", r.config.get("world_size", ""))), str(r.env.get("backend", "")),
               str(r.env.get("device", "")), str(r.env.get("created", "")), str(r.path)]
        if on_slurm:
            job = str(r.env.get("slurm_job") or r.env.get("slurm_job_id") or "")
            known = states.get(job)
            row += [job, known.state if known else "", (known.nodes if known else "") or r.env.get("slurm_nodelist") or "",
                    r.env.get("slurm_logs") or (str(known.logs) if known else "")]
        table.add_row(*row)
    console = Console(width=None if Console().is_terminal else 240)  # piped: do not cut paths at 80 columns
    console.print(table)
    hidden = len(runs) - shown
    if hidden:
        print(f"{hidden} incomplete/corrupt run(s) hidden; --all shows them")
    done = [r for r in runs if r.status == "complete"]
    complete = {str(r.env.get(k)) for r in done for k in ("slurm_job", "slurm_job_id") if r.env.get(k)}
    failed = [j for j in slurm_runs.unfinished(jobs, complete) if j.logs.parent not in {r.path for r in done}]
    if failed:
        print(f"\n{len(failed)} Slurm job(s) without a complete run:")
        for j in failed:
            where = f" (sweep point {j.sweep_point})" if j.sweep_point else ""
            console.print(f"  job {escape(j.job)}  {escape(j.state)}{escape(where)}  logs {escape(str(j.logs))}", highlight=False)
            for line in (j.error_tail or "(no error output)").splitlines():
                console.print(f"      {escape(line)}", highlight=False, soft_wrap=True)
    return 0
