"""`dtrain runs [PATHS] [--all] [--wide]`: what runs are there, and which are complete.

The default table fits 100 columns: each run's path relative to the folder listed (its start cut
with "…" when still too long), subproject, status, ranks, start time and, for runs launched on
Slurm, job id and state (sacct). `--wide` adds the full path, backend, device, node list, log
folder and the reason a run is incomplete. Below the table: Slurm jobs that left no complete run (a
failed sweep point, a crashed or cancelled job) with the last lines of their error
(dtrain/slurm_runs.py), and sweeps that sbatch refused (dtrain/slurm_sweep.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dtrain import slurm_runs
from dtrain.files import files_named
from dtrain.results import find_runs
from dtrain.slurm_sweep import SUBMISSION_FAILED

COMPACT = 100  # columns of the default listing


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list run directories and their status")
    p.add_argument("paths", nargs="*", default=["results"], help="run dirs or folders above them (default: results)")
    p.add_argument("--all", action="store_true", help="also list incomplete and corrupt runs")
    p.add_argument("--wide", action="store_true", help="every column, full paths (wider than 100 columns)")
    p.set_defaults(func=run)


def shorten(text: str, width: int) -> str:
    """The end of `text` (where a path differs) in `width` characters."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


def clip(text: str, width: int = COMPACT) -> str:
    """The start of `text` in `width` characters (a line of the lists below the table)."""
    return text if len(text) <= width else text[:width - 1] + "…"


def relative(path: Path, roots: list[str]) -> str:
    for root in roots:
        try:
            rel = path.resolve().relative_to(Path(root).resolve())
        except ValueError:
            continue
        return str(rel) if str(rel) != "." else path.name
    return str(path)


def _created(env: dict) -> str:
    c = str(env.get("created") or "")
    return f"{c[5:10]} {c[11:16]}" if len(c) >= 16 else c  # 2026-11-25T10:50:53+00:00 -> 11-25 10:50


def _ranks(r) -> str:
    world = r.env.get("world_size", r.config.get("world_size", ""))
    return " ".join(str(x) for x in (world, r.env.get("backend", ""), r.env.get("device", "")) if x != "")


def _state(job, known_job, sacct_ok: bool) -> str:
    if not job:
        return ""
    return known_job.state if known_job and known_job.state != "?" else ("unknown" if not sacct_ok else "")


def compact_table(cols: list[str], rows: list[list[str]], width: int = COMPACT) -> list[str]:
    """Plain columns two spaces apart in `width` characters: the first (the path) gets what the others
    leave, cut at its start ("…") when longer."""
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    widths[0] = max(min(widths[0], width - sum(widths[1:]) - 2 * (len(cols) - 1)), 12)
    out = []
    for row in [cols, *rows]:
        cells = [shorten(str(row[0]), widths[0]).ljust(widths[0])]
        cells += [str(x).ljust(w) for x, w in zip(row[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return out


def refused_sweeps(paths: list[str]) -> list[tuple[Path, dict]]:
    out = []
    for root in map(Path, paths):
        for note in files_named(root, SUBMISSION_FAILED) if root.is_dir() else []:
            try:
                out.append((note.parent, json.loads(note.read_text())))
            except (OSError, ValueError):
                out.append((note.parent, {"error": f"unreadable {note.name}"}))
    return out


def run(args) -> int:
    runs = find_runs(args.paths)
    jobs = slurm_runs.jobs_in(args.paths)
    states = {j.job: j for j in jobs}
    sacct_problem = slurm_runs.sacct_problem() if jobs or any(slurm_runs.job_of(r.env) for r in runs) else None
    on_slurm = any(slurm_runs.job_of(r.env) for r in runs) or bool(jobs)
    shown = [r for r in runs if r.status == "complete" or args.all]
    if args.wide:
        cols = ["subproject", "status", "world", "backend", "device", "created", "path"]
        cols += ["slurm job", "state", "nodes", "logs"] if on_slurm else []
    else:
        cols = ["run", "subproject", "status", "ranks", "created"] + (["job", "state"] if on_slurm else [])
    rows = []
    for r in shown:
        job = slurm_runs.job_of(r.env)
        known = states.get(job)
        state = _state(job, known, sacct_problem is None)
        if args.wide:
            style = {"complete": "green", "incomplete": "yellow", "corrupt": "red"}[r.status]
            row = [r.subproject, f"[{style}]{r.status}[/]" + (f" ({escape(r.reason)})" if r.reason else ""),
                   str(r.env.get("world_size", r.config.get("world_size", ""))), str(r.env.get("backend", "")),
                   str(r.env.get("device", "")), str(r.env.get("created", "")), escape(str(r.path))]
            if on_slurm:
                row += [job, state, (known.nodes if known else "") or r.env.get("slurm_nodelist") or "",
                        escape(str(r.env.get("slurm_logs") or (known.logs if known else "")))]
        else:
            row = [relative(r.path, args.paths), r.subproject, r.status, _ranks(r), _created(r.env)]
            row += [job, state] if on_slurm else []
        rows.append(row)
    title = f"{len(runs)} run(s) under {', '.join(args.paths)}"
    if args.wide:
        table = Table(title=title, box=box.SIMPLE_HEAD)
        for col in cols:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        Console(width=None if Console().is_terminal else 10_000).print(table)  # piped: whole paths, no wrap
    line = (lambda s: s) if args.wide else clip
    if not args.wide:
        print(line(title))
        for text in compact_table(cols, rows):
            print(text)
    hidden = len(runs) - len(shown)
    if hidden:
        print(f"{hidden} incomplete/corrupt run(s) hidden; --all shows them")
    if sacct_problem:  # --wide says it in full; the compact listing keeps to 100 columns
        print(line(f"Slurm state unknown: {sacct_problem}"))
    done = [r for r in runs if r.status == "complete"]
    complete = {slurm_runs.job_of(r.env) for r in done} - {""}
    failed = [j for j in slurm_runs.unfinished(jobs, complete) if j.logs.parent not in {r.path for r in done}]
    if failed:
        print(f"\n{len(failed)} Slurm job(s) without a complete run:")
        for j in failed:
            where = f" (sweep point {relative(Path(j.sweep_point), args.paths)})" if j.sweep_point else ""
            logs = f"  logs {j.logs}" if args.wide else ""
            print(line(f"  job {j.job}  {j.state if j.state != '?' else 'state unknown'}{where}{logs}"))
            for text in (j.error_tail or "(no error output)").splitlines():
                print(line(f"      {text}"))
    refused = refused_sweeps(args.paths)
    if refused:
        print(f"\n{len(refused)} sweep(s) refused at submission (nothing ran):")
        for folder, note in refused:
            print(line(f"  {relative(folder, args.paths)}  {note.get('time', '')}"))
            print(line(f"      {note.get('error', '')}"))
    return 0
