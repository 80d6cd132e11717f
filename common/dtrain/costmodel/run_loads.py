"""Each run's host load over its timed window (``run_loads``), from the capstone's timeline of its
processes' CPU and wait times (``LOAD_FILE``, ``dtrain.run.hostload``): the local check scales
that run's prediction by it."""

from __future__ import annotations

from pathlib import Path

from dtrain.results import contract_records
from dtrain.run import hostload

# the capstone's timeline of its processes' CPU and wait times (dtrain.run.hostload)
LOAD_FILE = "host-load.jsonl"


def run_window(run) -> tuple[float, float]:
    """When a run timed its steps: the trainer's timed steps end when records.jsonl was last written
    and last as long as their step times add up to; other runs span env.json to records.jsonl."""
    from dtrain.results.loader import read_jsonl

    records = run.path / "records.jsonl"
    end = (
        records.stat().st_mtime if records.exists() else (run.path / "summary.json").stat().st_mtime
    )
    steps = (
        [r for r in read_jsonl(records) if r.get("kind") == "step" and "warmup_step" in r]
        if records.exists()
        else []
    )
    timed = sum(float(r["step_time_s"]) for r in steps if not r["warmup_step"])
    return (end - timed, end) if timed > 0 else ((run.path / "env.json").stat().st_mtime, end)


def run_loads(
    results: Path, runs: list, timeline: list[hostload.Sample]
) -> list[contract_records.RunLoad]:
    """Each run's load factor over its timed window, its own oversubscription divided out (busy
    threads = ranks x threads per rank, against env.json's cores)."""
    out = []
    for run in runs:
        busy = int(run.env.get("world_size") or 1) * int(run.env.get("threads_per_rank") or 1)
        cores = int(run.env.get("cpu_count") or 0)
        lf = hostload.load_factor(timeline, *run_window(run), busy, cores or None)
        if lf is not None:
            out.append(
                contract_records.RunLoad(
                    str(run.path.resolve().relative_to(results.resolve())),
                    busy,
                    lf.median,
                    lf.low,
                    lf.high,
                    lf.samples,
                )
            )
    return out
