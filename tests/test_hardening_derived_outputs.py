"""Hardening, third round, derived outputs (docs/HARDENING.md): a report, the guide and the benches
write only where they may, checked before their work.

- a derived run (the fsdp study report, an FP8 comparison, the gemm-probe) claims its folder as a
  run does (`dtrain.results.derived.claim_output`): another run's folder, a folder inside one, a
  non-empty folder, a file or an unwritable path is one `error:` line, exit 2, nothing written;
- `dtrain guide` overwrites and removes only the plots it wrote
  (`<plots dir>/.dtrain-guide-plots.json`);
- output paths (`dtrain guide --out`, `dtrain capstone --out`, `scripts/bench-costmodel --out`) are
  checked before any work (`dtrain.core.checks.check_output_file`, `check_path`);
- a closed stdout (`dtrain runs | head -1`) ends the command quietly, exit 141.

No test here draws random numbers (nothing to seed).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from conftest import REPO, py
from dtrain.cli.main import main as dtrain_main
from dtrain.core.errors import UserError
from dtrain.guide import figures
from dtrain.results import derived
from dtrain.run import rundir
from dtrain.run.rundir import RunDirTaken

FIXTURES = REPO / "tests" / "fixtures" / "results"
TINY = [
    "-m",
    "fsdp_scaling",
    "model.preset=tiny",
    "train.steps=4",
    "train.timing_warmup=1",
    "profile.enabled=false",
    "world_size=1",
]
DTRAIN = Path(sys.executable).parent / "dtrain"


def _hashes(folder: Path) -> dict[str, str | None]:
    """Every entry under ``folder`` with its sha256 (None for a folder)."""
    return {
        str(p.relative_to(folder)): _sha(p) if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(capsys_or_text) -> str:
    err = capsys_or_text if isinstance(capsys_or_text, str) else capsys_or_text.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _unwritable_reason(folder: str) -> str:
    """What creating something in ``folder`` says here (root included), for the exact message."""
    try:
        os.mkdir(os.path.join(folder, "dtrain-probe"))
    except OSError as e:
        return e.strerror
    pytest.skip(f"{folder} is writable on this host")


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, Path]:
    """(results folder, the one real fsdp-scaling run in it): the input of the study report."""
    results = tmp_path_factory.mktemp("results")
    out = py(*TINY, f"results_dir={results}", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [run] = list((results / "fsdp-scaling").iterdir())
    return results, run


def _no_work(*args, **kwargs):
    pytest.fail("the guide started its work")


def _report(*args: str) -> int:
    from fsdp_scaling import report

    return report.main(list(args))


# ------------------------------------------------------------ 1. a derived run claims its folder


def test_report_into_another_runs_folder_is_refused_and_the_run_is_byte_identical(study):
    results, run = study
    before = _hashes(results)
    out = py("-m", "fsdp_scaling.report", str(results), "--out", str(run))
    assert out.returncode == 2 and out.stdout == ""
    owner = rundir.owner_text(run / rundir.OWNER)
    assert _one_line(out.stderr) == (
        f"error: --out {run} already holds a run ({owner}): pass a new --out; "
        "a derived run never writes into another run's folder"
    )
    assert _hashes(results) == before  # config.yaml, env.json, summary.json as they were


def test_report_refuses_a_folder_in_a_run_a_users_folder_a_file_an_unwritable_path(
    study, tmp_path, capsys
):
    results, run = study
    users = tmp_path / "pics"
    users.mkdir()
    (users / "notes.txt").write_text("mine\n")
    a_file = run / "config.yaml"
    owner = rundir.owner_text(run / rundir.OWNER)
    why = _unwritable_reason("/proc")
    cases = {
        str(run / "sub"): f"error: --out {run / 'sub'} is inside run {run} ({owner}): pass a --out "
        "outside any run's folder; a run never writes into another run's folder",
        str(users): f"error: --out {users} is not empty (it holds notes.txt): pass a new or empty "
        "--out; a derived run writes only into a folder it creates",
        str(a_file): f"error: --out={str(a_file)!r} cannot be used: {a_file} is a file, not a "
        "folder: pass another --out",
        "/proc/report": f"error: --out='/proc/report' is not writable ({why} in /proc): "
        "pass --out=<a writable folder>",
    }
    before, users_before = _hashes(results), _hashes(users)
    for out, message in cases.items():
        assert _report(str(results), "--out", out) == 2
        assert _one_line(capsys) == message
    assert _hashes(results) == before and _hashes(users) == users_before  # nothing written anywhere


def test_report_claims_its_folder_and_the_default_never_collides(
    study, tmp_path, monkeypatch, capsys
):
    results, _ = study
    out = tmp_path / "report"
    assert _report(str(results), "--out", str(out)) == 0
    owner = json.loads((out / rundir.OWNER).read_text())
    assert owner["pid"] == os.getpid()
    assert (out / "summary.json").exists() and (out / "scaling.csv").exists()
    assert _report(str(results), "--out", str(out)) == 2  # a report is a run: never written twice
    assert "already holds a run" in _one_line(capsys)
    monkeypatch.chdir(tmp_path)
    assert _report(str(results)) == 0 and _report(str(results)) == 0  # the default, in a second
    made = sorted((tmp_path / "results" / "fsdp-scaling").iterdir())
    assert len(made) == 2
    for p in made:  # report-<date>-<time>-<µs>
        assert p.name.startswith("report-") and len(p.name) == len("report-") + 22
        assert (p / rundir.OWNER).is_file()


def _claim_fresh(parent, barrier, queue):
    barrier.wait()
    queue.put(str(derived.claim_fresh(parent, "report-")))


def test_reports_started_at_once_get_their_own_folders_and_one_claims_a_named_one(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_claim_fresh, args=(tmp_path, barrier, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    made = {queue.get(timeout=5) for _ in procs}
    assert len(made) == 4 and all((Path(m) / rundir.OWNER).is_file() for m in made)
    # the same named folder from two processes at once: O_EXCL lets one win
    results = ctx.Queue()
    target = tmp_path / "named"

    def claim(barrier):
        barrier.wait()
        try:
            derived.claim_output(target)
            results.put("won")
        except UserError:
            results.put("refused")

    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=claim, args=(barrier,)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(results.get(timeout=5) for _ in procs) == ["refused"] * 3 + ["won"]


def test_write_derived_run_claims_its_folder_itself(tmp_path):
    """Every derived run (fp8 compare, gemm-probe, the report) goes through write_derived_run: a
    writer that did not claim its folder first still cannot write over a run."""
    run = tmp_path / "run"
    run.mkdir()
    rundir.claim(run)
    (run / "summary.json").write_text('{"status": "complete"}\n')
    before = _hashes(run)
    with pytest.raises(RunDirTaken, match=f"derived run folder {run} already holds a run"):
        derived.write_derived_run(run, "x", [], {"report": True}, {})
    with pytest.raises(UserError, match=f"is inside run {run}"):
        derived.write_derived_run(run / "report", "x", [], {"report": True}, {})
    assert _hashes(run) == before
    fresh = derived.write_derived_run(tmp_path / "report", "x", [run], {"report": True}, {})
    assert json.loads((fresh / "summary.json").read_text())["derived_from"] == ["../run"]
    assert (fresh / rundir.OWNER).is_file()


def test_a_second_gemm_probe_is_refused_before_it_times_anything(tmp_path, monkeypatch):
    """`python -m dtrain.costmodel.gemm_probe RESULTS` used to rewrite an earlier probe's run."""
    from dtrain.costmodel import gemm_probe

    results = tmp_path / "results"
    shutil.copytree(FIXTURES / "cpu", results)
    earlier = results / "gemm-probe"
    earlier.mkdir()
    rundir.claim(earlier)
    (earlier / "summary.json").write_text("{}\n")
    before = _hashes(earlier)
    monkeypatch.setattr(gemm_probe, "gemm_seconds", lambda *a: pytest.fail("timed a GEMM"))
    owner = rundir.owner_text(earlier / rundir.OWNER)
    with pytest.raises(RunDirTaken) as e:
        gemm_probe.probe(results)
    assert str(e.value) == (
        f"gemm-probe {earlier} already holds a run ({owner}): remove it to "
        "probe again; a derived run never writes into another run's folder"
    )
    assert _hashes(earlier) == before


def test_a_capstones_results_folder_holds_its_report(tmp_path):
    """The capstone claims its results folder for the runs it starts (run_dir null): its study
    report goes inside it (`--out <results>/fsdp-scaling/report`), as before."""
    cap = tmp_path / "capstone"
    rundir.claim_folder(cap, "--results-dir", None)
    out = derived.claim_output(cap / "fsdp-scaling" / "report")
    assert (out / rundir.OWNER).is_file()
    with pytest.raises(RunDirTaken):  # but not the capstone's folder itself
        derived.claim_output(cap)


def test_an_fp8_comparison_claims_its_folder_for_the_runs_it_starts_inside(tmp_path):
    """`fp8_train compare` claims compare-<time>/ before its sweep, whose runs go into
    compare-<time>/runs/: runs may be made there (run_dir null in the owner record), and the
    comparison is written at the end."""
    out = derived.claim_fresh(tmp_path / "fp8-train", "compare-", "results_dir", holds_runs=True)
    assert json.loads((out / rundir.OWNER).read_text())["run_dir"] is None
    rundir.check_outside_runs("results_dir", out / "runs", "results_dir")  # a run may go inside
    (out / "runs").mkdir()
    written = derived.write_derived_run(out, "fp8-train", [], {"mode": "compare"}, {})
    assert written == out and (out / "summary.json").exists()
    with pytest.raises(RunDirTaken, match="already holds a run"):  # from another process: taken
        derived._CLAIMED.clear()
        derived.claim_output(out, "--out")


# ------------------------------------------------------------ 2. the guide's plots


def _plot(folder: Path, name: str, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def test_guide_refuses_before_any_work_to_overwrite_a_plot_it_did_not_write(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    mine = _plot(Path("pics"), "mfu_vs_gpus.png", b"my own plot")
    _plot(Path("pics"), "predicted_vs_measured.png", b"another of mine")
    from dtrain.guide import guide_cli

    monkeypatch.setattr(guide_cli, "calibrate_naming_skips", _no_work)
    assert dtrain_main(["guide", "--no-results", "--out", "G.md", "--plots-dir", "pics"]) == 2
    assert _one_line(capsys) == (
        "error: --plots-dir pics holds pics/mfu_vs_gpus.png that dtrain "
        "guide did not write: move it or pass another --plots-dir"
    )
    mine.unlink()  # with runs, the plot of the local runs may be drawn: the user's is refused too
    cpu = str(FIXTURES / "cpu")
    assert dtrain_main(["guide", "--results", cpu, "--out", "G.md", "--plots-dir", "pics"]) == 2
    assert _one_line(capsys) == (
        "error: --plots-dir pics holds pics/predicted_vs_measured.png "
        "that dtrain guide did not write: move it or pass another "
        "--plots-dir"
    )
    _plot(Path("docs/guide"), "step_breakdown.png", b"mine")  # the default folder beside --out
    assert dtrain_main(["guide", "--no-results", "--out", "G.md"]) == 2
    assert _one_line(capsys) == (
        "error: --plots-dir docs/guide (the default, beside --out) holds "
        "docs/guide/step_breakdown.png that dtrain guide did not write: "
        "move it or pass another --plots-dir"
    )
    assert not Path("G.md").exists() and sorted(os.listdir("pics")) == ["predicted_vs_measured.png"]
    assert (Path("pics") / "predicted_vs_measured.png").read_bytes() == b"another of mine"


def test_a_stale_plot_is_removed_only_when_the_guide_wrote_it_and_it_is_unchanged(tmp_path):
    folder = tmp_path / "pics"
    drawn = [
        _plot(folder, f"{n}.png", n.encode())
        for n in ("mfu_vs_gpus", "mfu_vs_ib", "step_breakdown")
    ]
    ours = _plot(folder, "predicted_vs_measured.png", b"drawn from local runs")
    figures._record(folder, [*drawn, ours])  # a generation with local runs
    figures.check_plots_dir(folder, True, "--plots-dir pics")  # all the guide's: nothing refused
    figures._record(folder, [*drawn, None])  # then one without: the guide's own stale plot goes
    assert not ours.exists() and set(figures.read_manifest(folder)) == {p.name for p in drawn}
    users = _plot(folder, "predicted_vs_measured.png", b"the user's")  # not listed: left alone
    figures._record(folder, [*drawn, None])
    assert users.read_bytes() == b"the user's"
    figures._record(folder, [*drawn, _plot(folder, "predicted_vs_measured.png", b"drawn again")])
    users = _plot(folder, "predicted_vs_measured.png", b"edited by the user")  # listed, changed
    figures._record(folder, [*drawn, None])
    assert users.read_bytes() == b"edited by the user"
    assert "predicted_vs_measured.png" not in figures.read_manifest(folder)  # never touched again
    with pytest.raises(UserError, match="holds .*predicted_vs_measured.png that dtrain guide did"):
        figures.check_plots_dir(folder, True, "--plots-dir pics")
    (folder / figures.MANIFEST).write_text("[1, 2]")  # a manifest the guide did not write
    with pytest.raises(UserError, match=r"holds .*\.dtrain-guide-plots\.json that dtrain guide"):
        figures.check_plots_dir(folder, False, "--plots-dir pics")


def test_the_committed_guide_plots_are_listed_as_the_guides_own():
    """`dtrain guide` as the README runs it (plots into docs/guide/) may regenerate the committed
    plots and its stored local-check verdict."""
    folder = REPO / "docs" / "guide"
    listed = figures.read_manifest(folder)
    mine = [*folder.glob("*.png"), folder / "local-check.json"]
    assert sorted(listed) == sorted(p.name for p in mine)
    figures.check_plots_dir(folder, True, "--plots-dir docs/guide")


@pytest.mark.slow
def test_guide_without_runs_leaves_the_users_plot_of_local_runs_alone(tmp_path):
    """The reproduction: `--plots-dir pics` with the user's own pics/predicted_vs_measured.png and
    no runs used to delete it ("drop a stale plot"); now it is left as it was, and only the plots
    drawn are listed."""
    pics = tmp_path / "pics"
    users = _plot(pics, "predicted_vs_measured.png", b"the user's own")
    (pics / "holiday.jpg").write_bytes(b"jpg")
    out = subprocess.run(
        [
            str(DTRAIN),
            "guide",
            "--no-results",
            "--out",
            str(tmp_path / "G.md"),
            "--plots-dir",
            str(pics),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert users.read_bytes() == b"the user's own" and (pics / "holiday.jpg").read_bytes() == b"jpg"
    listed = figures.read_manifest(pics)
    assert sorted(listed) == ["mfu_vs_gpus.png", "mfu_vs_ib.png", "step_breakdown.png"]
    assert all(_sha(pics / n) == h for n, h in listed.items())
    assert "predicted_vs_measured" not in (tmp_path / "G.md").read_text()


# ------------------------------------------------------------ 3. output paths before any work


def test_guide_out_that_cannot_be_written_is_one_line_before_any_work(
    tmp_path, monkeypatch, capsys
):
    from dtrain.guide import guide_cli

    monkeypatch.setattr(guide_cli, "calibrate_naming_skips", _no_work)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    why = _unwritable_reason("/proc")
    cases = {
        str(a_file / "G.md"): f"error: --out={str(a_file / 'G.md')!r} cannot be used: {a_file} is "
        "a file, not a folder: pass another --out",
        str(tmp_path): f"error: --out={str(tmp_path)!r} is a folder, not a file: pass a file path, "
        f"e.g. --out={tmp_path / 'GUIDE.md'}",
        "/proc/G.md": f"error: --out='/proc/G.md' is not writable ({why} in /proc): "
        "pass --out=<a file in a writable folder>",
    }
    for out, message in cases.items():
        assert dtrain_main(["guide", "--no-results", "--out", out]) == 2
        assert _one_line(capsys) == message
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_capstone_checks_its_guide_path_before_any_experiment(tmp_path, monkeypatch, capsys):
    from dtrain.cli import capstone

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(capstone, "run_steps", lambda *a, **k: pytest.fail("an experiment started"))
    Path("a-file").write_text("x")
    assert dtrain_main(["capstone", "--out", "a-file/G.md"]) == 2
    assert _one_line(capsys) == (
        "error: --out='a-file/G.md' cannot be used: a-file is a file, "
        "not a folder: pass another --out"
    )
    _plot(Path("docs/guide"), "mfu_vs_ib.png", b"mine")  # where its guide's plots would go
    assert dtrain_main(["capstone", "--out", "G.md"]) == 2
    assert "holds docs/guide/mfu_vs_ib.png that dtrain guide did not write" in _one_line(capsys)
    assert sorted(os.listdir(".")) == ["a-file", "docs"]  # no results/capstone/<time>/ made


def _bench():
    path = REPO / "scripts" / "bench-costmodel"
    loader = importlib.machinery.SourceFileLoader("bench_costmodel_b2", str(path))
    spec = importlib.util.spec_from_loader("bench_costmodel_b2", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_bench_costmodel_checks_out_first_and_gets_its_own_folder(tmp_path, monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(bench, "commands", lambda out: pytest.fail("a command ran"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    why = _unwritable_reason("/proc")
    cases = {
        str(a_file): f"error: --out={str(a_file)!r} cannot be used: {a_file} is a file, not a "
        "folder: pass another --out",
        "/proc/bench": f"error: --out='/proc/bench' is not writable ({why} in /proc): "
        "pass --out=<a writable folder>",
    }
    for out, message in cases.items():
        monkeypatch.setattr(sys, "argv", ["bench-costmodel", "--repeat", "1", "--out", out])
        assert bench.main() == 2
        assert _one_line(capsys) == message
    assert a_file.read_text() == "x"

    class SameSecond(datetime):  # two benches at the same instant: the second takes the next one
        times = iter([datetime(2026, 1, 1, 12, 0, 0, 1)] * 2 + [datetime(2026, 1, 1, 12, 0, 0, 2)])

        @classmethod
        def now(cls, tz=None):
            return next(cls.times)

    monkeypatch.setattr(bench, "datetime", SameSecond)
    first, second = bench.new_folder(tmp_path / "b"), bench.new_folder(tmp_path / "b")
    assert (first.name, second.name) == ("20260101-120000-000001", "20260101-120000-000002")


# ------------------------------------------------------------ 4. a closed pipe


@pytest.fixture(scope="module")
def many_runs(tmp_path_factory) -> Path:
    """1,000 runs: `dtrain runs` prints more than a pipe holds (64 KiB), so `head -1` closes it
    while the command still writes."""
    root = tmp_path_factory.mktemp("many")
    [src] = [p for p in (FIXTURES / "cpu" / "fsdp-scaling").iterdir() if p.name.endswith("000000")]
    for i in range(1000):
        shutil.copytree(src, root / f"run-{i:04d}-{'x' * 60}")  # ~120 bytes a line
    return root


@pytest.mark.parametrize("command", ["runs {many}", "backtest --json"])
def test_a_closed_stdout_ends_the_command_quietly(command, many_runs):
    args = command.format(many=many_runs)
    line = f'"{DTRAIN}" {args} | head -1; echo "exit=${{PIPESTATUS[0]}}" >&2'
    out = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert len(out.stdout.splitlines()) == 1
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr
    assert out.stderr.strip().splitlines() == ["exit=141"], out.stderr[-2000:]
