"""`dtrain capstone`: every experiment at small size, then PARALLELISM_GUIDE.md from their runs.

    dtrain capstone                          local ranks (the embedded defaults), ~3-5 min on 2 CPU
                                             cores
    dtrain capstone --launcher slurm --set slurm.partition=gpu --set slurm.gpus_per_node=8
                                             each experiment as a Slurm job (launcher=slurm)

Each experiment runs as its own process, `python -m <package> results_dir=<dir> ...`, its output
going to <dir>/logs/<name>.log; a rich display shows which one is running (piped: a line per step
start and end, with elapsed time and an ETA from the steps' expected times). While the steps run,
`dtrain.run.hostload` records the CPU time other processes take (<dir>/host-load.jsonl): the local
check scales each run's prediction by the load it had. If a package is missing
or an experiment fails, the capstone names it, shows the end of its log and exits 1 without
writing a guide (a guide that silently lacks an experiment would mislead). Otherwise the guide is
generated from exactly this capstone's runs, plus the GPU measurements committed under measured/
(`make gpu-check` reports: their CUDA gemm-probe calibrates the GPU decision matrix; `--measured
none` leaves them out). The capstone only reads them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from dtrain.core.errors import UserError
from dtrain.core.terminal import on_terminal


@dataclass(frozen=True)
class Step:
    name: str  # subproject folder
    package: str
    args: tuple  # after `python -m <module>`; results_dir and launcher are added
    module: str = ""  # default: package
    needs_launcher: bool = True
    expected_s: float = (
        30.0  # on an idle 2-core host, local ranks: the ETA printed when output is piped
    )

    @property
    def command_module(self) -> str:
        return self.module or self.package


# The small configurations: each subproject's embedded default, plus what the guide needs from it.
# expected_s: measured on an idle 2-core host (make capstone, local launcher)
STEPS = (
    Step("allreduce-bench", "allreduce_bench", (), expected_s=10),
    # two strategies, so each fsdp run's step time is predicted from the other's efficiency
    Step("fsdp-scaling", "fsdp_scaling", ("-m", "train.strategy=ddp,zero3"), expected_s=20),
    # TP, TP x DP and PP layouts of the shared trainer: the guide predicts them too (their own rows)
    Step("fsdp-scaling tp", "fsdp_scaling", ("-m", "world_size=2,4", "train.tp=2"), expected_s=30),
    Step("fsdp-scaling pp", "fsdp_scaling", ("train.pp=2",), expected_s=14),
    Step(
        "fsdp-scaling report",
        "fsdp_scaling",
        ("{results}/fsdp-scaling", "--out", "{results}/fsdp-scaling/report"),
        module="fsdp_scaling.report",
        needs_launcher=False,
        expected_s=3,
    ),
    # an MoE model with expert parallelism (after the report: the study is of dense layouts): its
    # all-to-all share and overload, the contract's moe_run record
    Step(
        "fsdp-scaling moe",
        "fsdp_scaling",
        (
            "model.preset=tiny",
            "model.moe.experts=4",
            "model.moe.top_k=2",
            "train.ep=2",
            "train.steps=6",
            "train.log_every=0",
        ),
        expected_s=15,
    ),
    Step("tp-attention", "tp_attention", (), expected_s=25),
    # context parallelism (ring, all-to-all) vs one device vs TP+SP: the CpMeasurement records
    Step("tp-attention cp", "tp_attention", (), module="tp_attention.cp", expected_s=18),
    # FP8 speed and memory factors and the layers to keep in BF16 come from `compare`; without the
    # per-step tooling (NaN guard hooks on every linear, health and debug statistics), which would
    # dilute the speed factor and is not training work the cost model predicts (numerics runs keep
    # it: the default)
    Step(
        "fp8-train",
        "fp8_train",
        (
            "compare",
            "--recipes",
            "fp32,emulated_delayed",
            "--seeds",
            "0,1",
            "train.steps=20",
            "guard.enabled=false",
            "health.enabled=false",
            "fp8_debug.enabled=false",
        ),
        expected_s=40,
    ),
)
# after the experiments, in this process: the matmul probe over their runs, then the guide
PROBE_EXPECTED_S, GUIDE_EXPECTED_S = 20.0, 8.0


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


class StepProgress:
    """What runs now. On a terminal: a live display. Piped (CI, `| tee`): one line when a step
    starts (elapsed time, its expected time, the ETA of the whole capstone) and one when it ends."""

    def __init__(self, names: list[str], expected: list[float], console):
        self.names, self.expected, self.console = names, expected, console
        self.t0 = time.perf_counter()
        self.live = None
        if on_terminal():  # dtrain.core.terminal: a live display only where a person watches
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.live = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=console,
            )
            self.tasks = [self.live.add_task(f"[dim]{n}: waiting", total=1) for n in names]

    def __enter__(self) -> StepProgress:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def _eta(self, i: int, started: float) -> float:
        """Elapsed + what is left of step i (by its expected time) + the expected time of the
        later steps."""
        now = time.perf_counter() - self.t0
        return now + max(self.expected[i] - (now - started), 0.0) + sum(self.expected[i + 1 :])

    def _line(self, i: int, text: str) -> None:
        self.console.print(
            f"capstone [{i + 1}/{len(self.names)}] {self.names[i]}: {text}", highlight=False
        )

    def start(self, i: int) -> float:
        started = time.perf_counter() - self.t0
        if self.live:
            self.live.update(self.tasks[i], description=f"[bold]{self.names[i]}: running")
        else:
            self._line(
                i,
                f"started at {_clock(started)}, expected ~{self.expected[i]:.0f} s "
                f"(all done ~{_clock(self._eta(i, started))})",
            )
        return started

    def done(self, i: int, started: float) -> float:
        secs = time.perf_counter() - self.t0 - started
        if self.live:
            self.live.update(
                self.tasks[i],
                completed=1,
                description=f"[green]{self.names[i]}: done in {secs:.0f} s",
            )
        else:
            last = i + 1 == len(self.names)
            left = "" if last else f" (all done ~{_clock(self._eta(i, started))})"
            self._line(i, f"done in {secs:.0f} s at {_clock(time.perf_counter() - self.t0)}{left}")
        return secs

    def failed(self, i: int, why: str) -> None:
        if self.live:
            self.live.update(self.tasks[i], completed=1, description=f"[red]{self.names[i]}: {why}")
        else:
            self._line(i, f"FAILED: {why}")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "capstone",
        help="run all four experiments at small size, then write the guide",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--results-dir", help="where the runs go (default results/capstone/<time>)")
    p.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local ranks (default) or one Slurm job per experiment (launcher=slurm)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every experiment, e.g. --set slurm.partition=gpu",
    )
    p.add_argument(
        "--out",
        default="PARALLELISM_GUIDE.md",
        help="guide to write (default PARALLELISM_GUIDE.md)",
    )
    p.add_argument(
        "--measured",
        default="measured",
        help="committed GPU measurements the guide also reads (default measured/ when it exists; "
        "none: leave them out)",
    )
    names = sorted({s.name for s in STEPS})
    # metavar: argparse would print the choices as one unbreakable word, wider than a terminal
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=names,
        metavar="STEP",
        help="leave an experiment out (then no guide is written); one of: " + ", ".join(names),
    )
    p.set_defaults(func=run)


def gpu_measurements(measured: str) -> list[str]:
    """The committed GPU measurements the guide reads besides this capstone's runs
    (dtrain.guide.inputs, which `dtrain guide` shares)."""
    from dtrain.guide.inputs import gpu_measurements as measurements

    return measurements(measured)


def command(step: Step, results: Path, launcher: str, extra: list[str]) -> list[str]:
    args = [a.replace("{results}", str(results)) for a in step.args]
    cmd = [sys.executable, "-m", step.command_module, *args]
    if step.needs_launcher:
        cmd += [f"results_dir={results}", f"launcher={launcher}", *extra]
    return cmd


def missing_package(step: Step) -> str | None:
    try:
        found = (
            importlib.util.find_spec(f"{step.package}.__main__")
            if step.module == ""
            else importlib.util.find_spec(step.command_module)
        )
    except ModuleNotFoundError:
        found = None
    return (
        None if found else f"package {step.command_module} is not installed or has no entry point"
    )


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_steps(
    steps, results: Path, launcher: str, extra: list[str], progress: StepProgress
) -> list[tuple[str, str, float]]:
    """Run each step; returns (name, 'ok' | error, seconds). Stops at the first failure."""
    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    outcome = []
    for i, step in enumerate(steps):
        why = missing_package(step)
        if why:
            progress.failed(i, why)
            outcome.append((step.name, why, 0.0))
            break
        started = progress.start(i)
        log = logs / f"{step.name.replace(' ', '-')}.log"
        with open(log, "w") as f:
            f.write("$ " + " ".join(command(step, results, launcher, extra)) + "\n")
            f.flush()
            rc = subprocess.run(
                command(step, results, launcher, extra), stdout=f, stderr=subprocess.STDOUT
            ).returncode
        if rc:
            progress.failed(i, f"failed (exit {rc}), log {log}")
            outcome.append((step.name, f"exit code {rc}; last lines of {log}:\n{_tail(log)}", 0.0))
            break
        outcome.append((step.name, "ok", progress.done(i, started)))
    return outcome


def results_folder(explicit: str | None) -> Path:
    """This capstone's own folder, claimed atomically (dtrain.run.rundir.claim_folder): two
    capstones started in the same second get two folders, and an explicit --results-dir must be
    new or empty."""
    from dtrain.run import rundir

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
    from dtrain.core import terminal
    from dtrain.costmodel.gemm_probe import probe
    from dtrain.costmodel.run_loads import LOAD_FILE
    from dtrain.guide import inputs as guide_inputs
    from dtrain.guide.guide_cli import check_outputs, generate
    from dtrain.results.loader import find_runs
    from dtrain.run import hostload

    console = terminal.console(stderr=True)  # within 100 columns, lines wrapped by words
    bad = [s for s in args.set if "=" not in s]
    if bad:
        raise UserError(f"--set {bad[0]!r} is not KEY=VALUE, e.g. --set slurm.partition=gpu")
    measured = gpu_measurements(args.measured)  # before any step starts
    check_outputs(args.out, None, with_local=True)  # the guide is written last: checked first
    results = results_folder(args.results_dir)
    steps = [s for s in STEPS if s.name not in args.skip]
    names = [s.name for s in steps] + ["gemm-probe", "guide"]
    expected = [s.expected_s for s in steps] + [PROBE_EXPECTED_S, GUIDE_EXPECTED_S]
    console.print(
        f"capstone: {len(names)} steps ({len(steps)} experiment runs, the matmul probe, the "
        "guide), "
        f"launcher={args.launcher}",
        highlight=False,
    )
    console.print(
        f"capstone: about {_clock(sum(expected))} on an idle 2-core host; results in {results}",
        highlight=False,
    )
    t0 = time.perf_counter()
    results.mkdir(parents=True, exist_ok=True)
    # the CPU time other processes take while the steps run: the local check scales each run's
    # prediction by it
    with hostload.Sampler(results / LOAD_FILE), StepProgress(names, expected, console) as progress:
        outcome = run_steps(steps, results, args.launcher, args.set, progress)
        failed = [(n, why) for n, why, _ in outcome if why != "ok"]
        if not failed and not args.skip:
            started = progress.start(len(steps))
            probe(
                results
            )  # this host's GEMM curve and fixed step overhead for the runs' models (calibration)
            progress.done(len(steps), started)
            started = progress.start(len(steps) + 1)
            # recorded in the folder first: plain `dtrain guide` then reads the same inputs
            guide, plots = generate(guide_inputs.record(results, measured), args.out, quiet=True)
            progress.done(len(steps) + 1, started)
    not_run = [s.name for s in steps[len(outcome) :]]
    for name, why in failed:
        console.print(f"[red]error: {name} failed: {why}")
    if not_run:
        console.print(f"not run after the failure: {', '.join(not_run)}")
    if failed or args.skip:
        left = sorted({n for n, _ in failed} | set(not_run) | set(args.skip))
        console.print(f"[red]no guide written: it would lack {', '.join(left)}[/]")
        return 1
    runs = [r for r in find_runs([results]) if r.status == "complete"]
    console.print(f"\n[bold]capstone complete in {time.perf_counter() - t0:.0f} s[/]; wrote:")
    for r in runs:
        print(f"  run    {r.path}  ({r.subproject}{', derived' if r.derived else ''})")
    for p in plots:
        print(f"  plot   {p}")
    print(
        f"  guide  {guide}"
        + (f"  (with the GPU measurements in {', '.join(measured)})" if measured else "")
    )
    print(f"  logs   {results / 'logs'}")
    return 0
