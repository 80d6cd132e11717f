"""`dtrain runs [PATHS] [--all] [--wide]`: what runs are there, and which are complete.

The default table fits 100 columns: each run's path relative to the folder listed (its middle cut
with "…" when still too long: the sweep point's number at the end stays), subproject, status,
ranks, start time, the overrides that tell it from the other runs of its subproject listed (those
all share are left out: sweep points differ by their swept keys) and, for runs launched on Slurm,
job id and state (sacct). `--wide` adds the full path, every override, backend, device, node list,
log folder and the reason a run is incomplete. Below the table: Slurm jobs that left no complete
run (a failed sweep point, a crashed or cancelled job) with the last lines of their error
(dtrain/slurm/jobs.py), and sweeps that sbatch refused (dtrain/slurm/submitit_sweep.py).
"""

from __future__ import annotations

import json
from dtrain.core import terminal
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dtrain.core.files import files_named
from dtrain.results.loader import find_runs
from dtrain.results.metrics import run_overrides
from dtrain.slurm.jobs import job_of, jobs_in, sacct_problem, unfinished
from dtrain.slurm.submitit_sweep import SUBMISSION_FAILED

COMPACT = 100  # columns of the default listing


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list run directories and their status")
    p.add_argument(
        "paths",
        nargs="*",
        default=["results"],
        help="run dirs or folders above them (default: results)",
    )
    p.add_argument("--all", action="store_true", help="also list incomplete and corrupt runs")
    p.add_argument(
        "--wide", action="store_true", help="every column, full paths (wider than 100 columns)"
    )
    p.set_defaults(func=run)


def shorten(text: str, width: int) -> str:
    """`text` in `width` characters, its middle cut: a path keeps its start (the subproject) and the
    longer end (the run id, the sweep point's number), where runs differ."""
    if len(text) <= width:
        return text
    tail = (2 * (width - 1) + 2) // 3
    return text[: width - 1 - tail] + "…" + text[-tail:]


def distinguishing(overrides: list[list[str]], groups: list[str]) -> list[str]:
    """Each run's overrides less those every other run of its group (subproject) has too, when the
    group has more than one run: "-" when nothing else is left, "(defaults)" for none at all."""
    shared = {}
    for g in set(groups):
        mine = [set(o) for o, h in zip(overrides, groups) if h == g]
        shared[g] = set.intersection(*mine) if len(mine) > 1 else set()
    return [
        " ".join(o for o in these if o not in shared[g]) or ("-" if these else "(defaults)")
        for these, g in zip(overrides, groups)
    ]


def wrap(text: str, width: int = COMPACT) -> str:
    """All of `text`, wrapped by words within `width` columns (a line of --wide's lists)."""
    import textwrap

    return textwrap.fill(
        text, width, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False
    )


def clip(text: str, width: int = COMPACT) -> str:
    """The start of `text` in `width` characters (a line of the lists below the table)."""
    return text if len(text) <= width else text[: width - 1] + "…"


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
    return (
        f"{c[5:10]} {c[11:16]}" if len(c) >= 16 else c
    )  # 2026-11-25T10:50:53+00:00 -> 11-25 10:50


def _ranks(r) -> str:
    world = r.env.get("world_size", r.config.get("world_size", ""))
    return " ".join(
        str(x) for x in (world, r.env.get("backend", ""), r.env.get("device", "")) if x != ""
    )


def _state(job, known_job, sacct_ok: bool) -> str:
    if not job:
        return ""
    return (
        known_job.state
        if known_job and known_job.state != "?"
        else ("unknown" if not sacct_ok else "")
    )


def compact_table(
    cols: list[str],
    rows: list[list[str]],
    width: int = COMPACT,
    flexible: dict[int, int] | None = None,
) -> list[str]:
    """Plain columns two spaces apart in `width` characters. The `flexible` columns (index: least
    width; default the first, the path) share what the others leave, the widest giving way first:
    a path is cut in its middle, any other at its end ("…")."""
    flexible = {0: 12} if flexible is None else flexible
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    while sum(widths) + 2 * (len(cols) - 1) > width:
        give = [i for i in flexible if widths[i] > flexible[i]]
        i = max(give, key=lambda i: widths[i], default=None)
        if i is None:
            break
        widths[i] -= 1
    out = []
    for row in [cols, *rows]:
        cells = [
            (shorten(str(x), w) if i == 0 else clip(str(x), w)).ljust(w)
            for i, (x, w) in enumerate(zip(row, widths))
        ]
        out.append("  ".join(cells).rstrip())
    return out


def wide_lines(title: str, cols: list[str], rows: list[list[str]]) -> None:
    """`--wide`: each run as a block within the terminal's width (at most 100 columns): its short
    columns on one line, then each long one (path, overrides, Slurm logs) on its own lines, paths
    broken after a "/" and overrides between words, never inside a name."""
    console = Console(width=terminal.width(), soft_wrap=True, highlight=False)
    console.print(title, markup=False)
    long = {"path", "overrides", "logs"}
    for row in rows:
        cells = dict(zip(cols, row))
        console.print("  ".join(v for k, v in cells.items() if k not in long and v))
        for k in ("path", "overrides", "logs"):
            text = cells.get(k, "")
            if not text:
                continue
            words = text.replace("/", "/\0").split("\0") if k != "overrides" else text.split(" ")
            lines, cur = [], f"    {k:<10}"
            for w in words:
                sep = "" if k != "overrides" or cur.endswith(" ") else " "
                if len(cur) + len(sep) + len(w) > terminal.width() and cur.strip() != k:
                    lines.append(cur)
                    cur = " " * 14 + w
                else:
                    cur += sep + w
            console.print("\n".join([*lines, cur]))


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
    jobs = jobs_in(args.paths)
    states = {j.job: j for j in jobs}
    sacct_note = sacct_problem() if jobs or any(job_of(r.env) for r in runs) else None
    on_slurm = any(job_of(r.env) for r in runs) or bool(jobs)
    shown = [r for r in runs if r.status == "complete" or args.all]
    if args.wide:
        cols = [
            "subproject",
            "status",
            "world",
            "backend",
            "device",
            "created",
            "path",
            "overrides",
        ]
        cols += ["slurm job", "state", "nodes", "logs"] if on_slurm else []
    else:
        cols = ["run", "subproject", "status", "ranks", "created", "overrides"]
        cols += ["job", "state"] if on_slurm else []
    every = [run_overrides(r.path) for r in shown]
    differ = distinguishing(every, [r.subproject for r in shown])
    rows = []
    for r, overrides, own in zip(shown, every, differ):
        job = job_of(r.env)
        known = states.get(job)
        state = _state(job, known, sacct_note is None)
        if args.wide:
            style = {"complete": "green", "incomplete": "yellow", "corrupt": "red"}[r.status]
            row = [
                r.subproject,
                f"[{style}]{r.status}[/]" + (f" ({escape(r.reason)})" if r.reason else ""),
                str(r.env.get("world_size", r.config.get("world_size", ""))),
                str(r.env.get("backend", "")),
                str(r.env.get("device", "")),
                str(r.env.get("created", "")),
                escape(str(r.path)),
                escape(" ".join(overrides)),
            ]
            if on_slurm:
                row += [
                    job,
                    state,
                    (known.nodes if known else "") or r.env.get("slurm_nodelist") or "",
                    escape(str(r.env.get("slurm_logs") or (known.logs if known else ""))),
                ]
        else:
            row = [
                relative(r.path, args.paths),
                r.subproject,
                r.status,
                _ranks(r),
                _created(r.env),
                own,
            ]
            row += [job, state] if on_slurm else []
        rows.append(row)
    title = f"{len(runs)} run(s) under {', '.join(args.paths)}"
    if args.wide:
        wide_lines(title, cols, rows)
    line = wrap if args.wide else clip
    if not args.wide:
        print(line(title))
        for text in compact_table(cols, rows, flexible={0: 12, 5: 12}):
            print(text)
    hidden = len(runs) - len(shown)
    if hidden:
        print(f"{hidden} incomplete/corrupt run(s) hidden; --all shows them")
    if sacct_note:  # --wide says it in full, wrapped; the compact listing clips it
        print(line(f"Slurm state unknown: {sacct_note}"))
    done = [r for r in runs if r.status == "complete"]
    complete = {job_of(r.env) for r in done} - {""}
    failed = [j for j in unfinished(jobs, complete) if j.logs.parent not in {r.path for r in done}]
    if failed:
        print(f"\n{len(failed)} Slurm job(s) without a complete run:")
        for j in failed:
            where = (
                f" (sweep point {relative(Path(j.sweep_point), args.paths)})"
                if j.sweep_point
                else ""
            )
            logs = f"  logs {j.logs}" if args.wide else ""
            print(
                line(
                    f"  job {j.job}  {j.state if j.state != '?' else 'state unknown'}{where}{logs}"
                )
            )
            for text in (j.error_tail or "(no error output)").splitlines():
                print(line(f"      {text}"))
    refused = refused_sweeps(args.paths)
    if refused:
        print(f"\n{len(refused)} sweep(s) refused at submission (nothing ran):")
        for folder, note in refused:
            print(line(f"  {relative(folder, args.paths)}  {note.get('time', '')}"))
            print(line(f"      {note.get('error', '')}"))
    return 0
