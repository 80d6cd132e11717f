"""`dtrain runs [PATHS]`: what runs are there, and which are complete."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dtrain.results import find_runs


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list run directories and their status")
    p.add_argument("paths", nargs="*", default=["results"], help="run dirs or folders above them (default: results)")
    p.add_argument("--all", action="store_true", help="also list incomplete and corrupt runs")
    p.set_defaults(func=run)


def run(args) -> int:
    runs = find_runs(args.paths)
    table = Table(title=f"{len(runs)} run(s) under {', '.join(args.paths)}")
    for col in ("subproject", "status", "world", "backend", "device", "created", "path"):
        table.add_column(col)
    shown = 0
    for r in runs:
        if r.status != "complete" and not args.all:
            continue
        shown += 1
        style = {"complete": "green", "incomplete": "yellow", "corrupt": "red"}[r.status]
        table.add_row(r.subproject, f"[{style}]{r.status}[/]" + (f" ({r.reason})" if r.reason else ""),
                      str(r.env.get("world_size", r.config.get("world_size", ""))), str(r.env.get("backend", "")),
                      str(r.env.get("device", "")), str(r.env.get("created", "")), str(r.path))
    Console().print(table)
    hidden = len(runs) - shown
    if hidden:
        print(f"{hidden} incomplete/corrupt run(s) hidden; --all shows them")
    return 0
