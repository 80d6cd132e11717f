"""`dtrain capstone`: every experiment at small size, then PARALLELISM_GUIDE.md from their runs.

    dtrain capstone                          local ranks (the embedded defaults), ~3-5 min on 2 CPU cores
    dtrain capstone --launcher slurm --set slurm.partition=gpu --set slurm.gpus_per_node=8
                                             each experiment as a Slurm job (launcher=slurm)

Each experiment runs as its own process, `python -m <package> results_dir=<dir> ...`, its output
going to <dir>/logs/<name>.log; a rich display shows which one is running. If a package is missing
or an experiment fails, the capstone names it, shows the end of its log and exits 1 without
writing a guide (a guide that silently lacks an experiment would mislead). Otherwise the guide is
generated from exactly this capstone's runs.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from dtrain.errors import UserError


@dataclass(frozen=True)
class Step:
    name: str            # subproject folder
    package: str
    args: tuple          # after `python -m <module>`; results_dir and launcher are added
    module: str = ""     # default: package
    needs_launcher: bool = True

    @property
    def command_module(self) -> str:
        return self.module or self.package


# The small configurations: each subproject's embedded default, plus what the guide needs from it.
STEPS = (
    Step("allreduce-bench", "allreduce_bench", ()),
    # two strategies, so each fsdp run's step time is predicted from the other's efficiency
    Step("fsdp-scaling", "fsdp_scaling", ("-m", "train.strategy=ddp,zero3")),
    # TP, TP x DP and PP layouts of the shared trainer: the guide predicts them too (their own rows)
    Step("fsdp-scaling tp", "fsdp_scaling", ("-m", "world_size=2,4", "train.tp=2")),
    Step("fsdp-scaling pp", "fsdp_scaling", ("train.pp=2",)),
    Step("fsdp-scaling report", "fsdp_scaling", ("{results}/fsdp-scaling", "--out", "{results}/fsdp-scaling/report"),
         module="fsdp_scaling.report", needs_launcher=False),
    Step("tp-attention", "tp_attention", ()),
    # FP8 speed and memory factors and the layers to keep in BF16 come from `compare`; without the per-step
    # tooling (NaN guard hooks on every linear, health and debug statistics), which would dilute the speed
    # factor and is not training work the cost model predicts (numerics runs keep it: the default)
    Step("fp8-train", "fp8_train", ("compare", "--recipes", "fp32,emulated_delayed", "--seeds", "0,1",
                                    "train.steps=20", "guard.enabled=false", "health.enabled=false",
                                    "fp8_debug.enabled=false")),
)


def add_parser(sub) -> None:
    p = sub.add_parser("capstone", help="run all four experiments at small size, then write the guide",
                       description=__doc__.split("\n")[0])
    p.add_argument("--results-dir", help="where the runs go (default results/capstone/<time>)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local ranks (default) or one Slurm job per experiment (launcher=slurm)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every experiment, e.g. --set slurm.partition=gpu")
    p.add_argument("--out", default="PARALLELISM_GUIDE.md", help="guide to write (default PARALLELISM_GUIDE.md)")
    p.add_argument("--skip", action="append", default=[], choices=sorted({s.name for s in STEPS}),
                   help="leave an experiment out (then no guide is written)")
    p.set_defaults(func=run)


def command(step: Step, results: Path, launcher: str, extra: list[str]) -> list[str]:
    args = [a.replace("{results}", str(results)) for a in step.args]
    cmd = [sys.executable, "-m", step.command_module, *args]
    if step.needs_launcher:
        cmd += [f"results_dir={results}", f"launcher={launcher}", *extra]
    return cmd


def missing_package(step: Step) -> str | None:
    try:
        found = importlib.util.find_spec(f"{step.package}.__main__") if step.module == "" else \
            importlib.util.find_spec(step.command_module)
    except ModuleNotFoundError:
        found = None
    return None if found else f"package {step.command_module} is not installed or has no entry point"


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_steps(steps, results: Path, launcher: str, extra: list[str], console) -> list[tuple[str, str, float]]:
    """Run each step; returns (name, 'ok' | error, seconds). Stops at the first failure."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    outcome = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar:
        tasks = {s.name: bar.add_task(f"[dim]{s.name}: waiting", total=1) for s in steps}
        for step in steps:
            task = tasks[step.name]
            why = missing_package(step)
            if why:
                bar.update(task, description=f"[red]{step.name}: {why}")
                outcome.append((step.name, why, 0.0))
                break
            bar.update(task, description=f"[bold]{step.name}: running")
            log = logs / f"{step.name.replace(' ', '-')}.log"
            t0 = time.perf_counter()
            with open(log, "w") as f:
                f.write("$ " + " ".join(command(step, results, launcher, extra)) + "\n")
                f.flush()
                rc = subprocess.run(command(step, results, launcher, extra), stdout=f, stderr=subprocess.STDOUT).returncode
            secs = time.perf_counter() - t0
            if rc:
                bar.update(task, completed=1, description=f"[red]{step.name}: failed (exit {rc}), log {log}")
                outcome.append((step.name, f"exit code {rc}; last lines of {log}:\n{_tail(log)}", secs))
                break
            bar.update(task, completed=1, description=f"[green]{step.name}: done in {secs:.0f} s")
            outcome.append((step.name, "ok", secs))
    return outcome


def results_folder(explicit: str | None) -> Path:
    """This capstone's own folder, claimed atomically (dtrain.rundir.claim_folder): two capstones started
    in the same second get two folders, and an explicit --results-dir must be new or empty."""
    from dtrain import rundir

    if explicit:
        rundir.claim_folder(Path(explicit), "--results-dir", None)
        return Path(explicit)
    while True:
        path = Path(f"results/capstone/{datetime.now():%Y%m%d-%H%M%S-%f}")
        try:
            path.mkdir(parents=True)  # exist_ok=False: the one that creates it owns it
        except FileExistsError:
            continue
        rundir.claim_folder(path, "--results-dir", None)
        return path


def run(args) -> int:
    from rich.console import Console

    from dtrain.guide.cli import generate
    from dtrain.results import find_runs

    console = Console(stderr=True)
    bad = [s for s in args.set if "=" not in s]
    if bad:
        raise UserError(f"--set {bad[0]!r} is not KEY=VALUE, e.g. --set slurm.partition=gpu")
    results = results_folder(args.results_dir)
    steps = [s for s in STEPS if s.name not in args.skip]
    console.print(f"capstone: {len(steps)} step(s), launcher={args.launcher}, results in {results}")
    t0 = time.perf_counter()
    outcome = run_steps(steps, results, args.launcher, args.set, console)
    failed = [(n, why) for n, why, _ in outcome if why != "ok"]
    not_run = [s.name for s in steps[len(outcome):]]
    for name, why in failed:
        console.print(f"[red]error: {name} failed: {why}")
    if not_run:
        console.print(f"not run after the failure: {', '.join(not_run)}")
    if failed or args.skip:
        left = sorted({n for n, _ in failed} | set(not_run) | set(args.skip))
        console.print(f"[red]no guide written: it would lack {', '.join(left)}[/]")
        return 1
    from dtrain.costmodel.gemm_probe import probe

    t_probe = time.perf_counter()
    probe(results)  # this host's GEMM curve and fixed step overhead for the runs' models (cost model calibration)
    console.print(f"gemm-probe: done in {time.perf_counter() - t_probe:.0f} s")
    guide, plots = generate([str(results)], args.out, quiet=True)
    runs = [r for r in find_runs([results]) if r.status == "complete"]
    console.print(f"\n[bold]capstone complete in {time.perf_counter() - t0:.0f} s[/]; wrote:")
    for r in runs:
        print(f"  run    {r.path}  ({r.subproject}{', derived' if r.derived else ''})")
    for p in plots:
        print(f"  plot   {p}")
    print(f"  guide  {guide}")
    print(f"  logs   {results / 'logs'}")
    return 0
