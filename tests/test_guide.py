"""`dtrain guide` and `dtrain capstone`: deterministic output, rules that match the matrix, and
no guide when an experiment is missing."""

import re
from pathlib import Path

import pytest

from conftest import REPO, py
from dtrain.cli import capstone
from dtrain.cli.main import main
from dtrain.guide.guide_cli import generate
from dtrain.guide.matrix import Cell, cell_text
from dtrain.guide.rules import rule_ib, rule_tp_in_node, rule_zero

FIXTURES = Path(__file__).parent / "fixtures" / "results"


def cpu_guide_into(folder: Path) -> tuple[Path, list[Path]]:
    return generate([str(FIXTURES / "cpu")], folder / "GUIDE.md", folder / "plots", quiet=True)


@pytest.fixture(scope="module")
def gpu_guide(tmp_path_factory):
    """The guide from the CPU and the GPU fixture results, its plots in the default folder beside
    it (one generation for the tests below: about 11 s on the 2-core CI machine)."""
    folder = tmp_path_factory.mktemp("g")
    return generate([str(FIXTURES / "cpu"), str(FIXTURES / "gpu")], folder / "G.md", quiet=True)


@pytest.mark.slow  # two whole generations
def test_guide_regenerates_byte_identically(tmp_path):
    """The CPU results alone: the matrix on datasheet values, the same bytes every time."""
    (a, plots_a), (b, plots_b) = cpu_guide_into(tmp_path / "a"), cpu_guide_into(tmp_path / "b")
    assert "No GPU results: the decision matrix uses datasheet/published values." in a.read_text()
    assert a.read_bytes() == b.read_bytes()
    assert (
        [p.name for p in plots_a]
        == [p.name for p in plots_b]
        == ["mfu_vs_gpus.png", "mfu_vs_ib.png", "step_breakdown.png", "predicted_vs_measured.png"]
    )
    for pa, pb in zip(plots_a, plots_b):
        assert pa.read_bytes() == pb.read_bytes(), pa.name


def test_guide_sections_provenance_and_plots(gpu_guide):
    guide, plots = gpu_guide
    text = guide.read_text()
    for section in (
        "## How to read it",
        "## Rules the matrix shows",
        "## Decision matrix",
        "## Calibration",
        "## Predicted vs measured (local runs)",
        "## FP8",
        "## Plots",
    ):
        assert section in text
    assert "skipped 1 incomplete or corrupt" in text and "20250301-100500-crashed" in text
    # 7 models x 6 GPU counts, 8 columns each
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| ", line)]
    assert len(rows) == 7 * 6 and all(line.count(" | ") == 8 for line in rows)
    # the GEMM curve is the H100's kernel benchmark until a CUDA gemm-probe measures it
    assert (
        "| GEMM achieved fraction of the roofline bound, large GEMMs (e_max) | 82.0% | "
        "datasheet/published:" in text
    )
    assert "measured here: " in text and ", cpu (gloo, 2 ranks)" in text
    for p in plots:  # referenced relative to the guide
        assert f"]({p.relative_to(guide.parent).as_posix()})" in text
    assert re.search(r"\*\*\d+ of 6 within the goal\.\*\*", text)
    # no timestamp but the results' (the fixture runs of 2025-03-01 and -02)
    assert not re.search(r"20\d\d-\d\d-\d\dT", re.sub(r"2025-03-0[12]T", "", text))


def test_gpu_results_calibrate_the_matrix(gpu_guide):
    guide, _ = gpu_guide
    text = guide.read_text()
    assert "uses values measured on CUDA GPUs where they exist" in text
    # GPU training runs calibrate the DP overlap (their MFU checks the model; only a CUDA gemm-probe
    # sets the curve)
    row = next(
        line
        for line in text.splitlines()
        if line.startswith("| share of overlapped DP/ZeRO traffic hidden")
    )
    assert "| 81% | measured here: " in row and "NVIDIA H100 80GB HBM3" in row
    # the default plots dir beside the guide
    assert (guide.parent / "docs" / "guide" / "mfu_vs_gpus.png").exists()


def _cell(**kw):
    base = dict(
        model="7B",
        params=7e9,
        gpus=64,
        topology="NVLink",
        ib_gbit=400,
        fits=True,
        dp=8,
        tp=8,
        pp=1,
        zero=1,
        recompute="none",
        micro_batch=1,
        mfu=0.4,
        mem_gib=50.0,
        step_s=1.0,
    )
    return Cell(**{**base, **kw})


def test_cell_text():
    assert (
        cell_text(_cell(virtual_stages=2, recompute="full"))
        == "8×8×1 Z1 mb1 v2 full rc<br>40% · 50 GiB"
    )
    assert (
        cell_text(_cell(recompute="op")) == "8×8×1 Z1 mb1 op rc<br>40% · 50 GiB"
    )  # never shown as full
    assert cell_text(_cell(fits=False)) == "does not fit"


def test_rules_follow_the_cells():
    cells = [_cell(), _cell(gpus=128, tp=16, dp=8)]
    assert "crosses nodes in 1 of 2 cells" in rule_tp_in_node(
        cells
    ) and "7B@128" in rule_tp_in_node(cells)
    assert "TP ≤ 8 in all 1 cells" in rule_tp_in_node(cells[:1])
    assert "ZeRO-1 1, ZeRO-3 1" in rule_zero([_cell(), _cell(zero=3, model="70B", params=70e9)])
    ib = [
        _cell(ib_gbit=100, mfu=0.30, pp=2),
        _cell(ib_gbit=800, mfu=0.40),
        _cell(gpus=128, ib_gbit=100, mfu=0.36),
        _cell(gpus=128, ib_gbit=800, mfu=0.40),
    ]
    text = rule_ib(ib)
    assert "median 17.5% of predicted MFU over 2 multi-node cells" in text  # median of 25% and 10%
    assert "changes in 1 of them (1 with deeper pipelines" in text


def test_guide_cli_missing_results_is_exit_2(capsys, tmp_path):
    assert (
        main(["guide", "--results", str(tmp_path / "none"), "--out", str(tmp_path / "G.md")]) == 2
    )
    assert "no such results path" in capsys.readouterr().err
    assert not (tmp_path / "G.md").exists()


def test_capstone_stops_without_a_guide_when_a_package_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(capstone, "STEPS", (capstone.Step("ghost", "no_such_pkg_xyz", ()),))
    out = tmp_path / "G.md"
    code = main(["capstone", "--results-dir", str(tmp_path / "r"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    assert (
        "ghost failed: package no_such_pkg_xyz is not installed" in err
        and "no guide written" in err
    )


def test_capstone_reports_a_failing_experiment_with_its_log(monkeypatch, tmp_path, capsys):
    bad = capstone.Step(
        "broken", "json", ("--no-such-flag",), module="json.tool", needs_launcher=False
    )
    later = capstone.Step("later", "json", (), module="json.tool", needs_launcher=False)
    monkeypatch.setattr(capstone, "STEPS", (bad, later))
    out = tmp_path / "G.md"
    code = main(["capstone", "--results-dir", str(tmp_path / "r"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    assert "broken failed: exit code 2" in err and "no-such-flag" in err  # the log's tail is shown
    assert "not run after the failure: later" in err
    assert (tmp_path / "r" / "logs" / "broken.log").exists()


def test_capstone_piped_prints_a_line_per_step_with_elapsed_time_and_eta(
    monkeypatch, tmp_path, capsys
):
    """Not on a terminal (CI, `| tee`): each step's start and end is a line, the probe and guide
    included."""
    from dtrain.costmodel import gemm_probe
    from dtrain.guide import guide_cli

    steps = tuple(
        capstone.Step(n, "this", (), module="this", needs_launcher=False, expected_s=e)
        for n, e in (("first", 30), ("second", 60))
    )
    monkeypatch.setattr(capstone, "STEPS", steps)
    monkeypatch.setattr(capstone, "PROBE_EXPECTED_S", 20.0)
    monkeypatch.setattr(capstone, "GUIDE_EXPECTED_S", 10.0)
    monkeypatch.setattr(gemm_probe, "probe", lambda results: results / "gemm-probe")
    monkeypatch.setattr(guide_cli, "generate", lambda results, out, quiet: (Path(out), []))
    assert (
        main(["capstone", "--results-dir", str(tmp_path / "r"), "--out", str(tmp_path / "G.md")])
        == 0
    )
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("capstone")]
    assert err[0].startswith("capstone: 4 steps (2 experiment runs, the matmul probe, the guide)")
    # the second line (the first fits 100 columns)
    assert err[1].startswith("capstone: about 2:00 on an idle 2-core host; results in ")
    names = ["first", "second", "gemm-probe", "guide"]
    starts = [ln for ln in err if "started at" in ln]
    assert [ln.split("] ")[1].split(":")[0] for ln in starts] == names
    assert re.fullmatch(
        r"capstone \[1/4\] first: started at 0:00, expected ~30 s \(all done ~2:00\)", starts[0]
    )
    assert re.fullmatch(
        r"capstone \[2/4\] second: started at 0:0\d, expected ~60 s \(all done ~1:3\d\)", starts[1]
    )
    ends = [ln for ln in err if ": done in " in ln]
    assert len(ends) == 4 and ends[-1].startswith("capstone [4/4] guide: done in 0 s at 0:0")


def test_capstone_commands_pass_results_dir_and_launcher(tmp_path):
    steps = {s.name: s for s in capstone.STEPS}
    cmd = capstone.command(steps["tp-attention"], tmp_path, "slurm", ["slurm.partition=gpu"])
    assert cmd[1:3] == ["-m", "tp_attention"]
    assert cmd[-3:] == [f"results_dir={tmp_path}", "launcher=slurm", "slurm.partition=gpu"]
    report = capstone.command(steps["fsdp-scaling report"], tmp_path, "slurm", [])
    assert report[1:] == [
        "-m",
        "fsdp_scaling.report",
        f"{tmp_path}/fsdp-scaling",
        "--out",
        f"{tmp_path}/fsdp-scaling/report",
    ]
    assert {s.name.split()[0] for s in capstone.STEPS} == {
        "allreduce-bench",
        "fsdp-scaling",
        "tp-attention",
        "fp8-train",
    }


@pytest.mark.slow
def test_capstone_end_to_end(tmp_path):
    """The main job: all four experiments at small size on local ranks, then the guide (~4-5
    min)."""
    out = tmp_path / "GUIDE.md"
    r = py(
        "-m",
        "dtrain.cli.main",
        "capstone",
        "--results-dir",
        str(tmp_path / "r"),
        "--out",
        str(out),
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    for sub in ("allreduce-bench", "fsdp-scaling", "tp-attention", "fp8-train"):
        assert f"/{sub}/" in text, sub
    assert "guide  " in r.stdout and "run    " in r.stdout
    # the README's guide command, as written, finds this capstone as the latest under
    # results/capstone/
    from test_readme import bare_shell, commands

    [cmd] = [c for c in commands() if c.startswith("dtrain guide") and "results/capstone" in c]
    cwd = tmp_path / "checkout"
    (cwd / "results" / "capstone").mkdir(parents=True)
    (cwd / "results" / "capstone" / "20990101-000000-000000").symlink_to(tmp_path / "r")
    for shared in (".venv", "measured"):
        (cwd / shared).symlink_to(REPO / shared)
    g = bare_shell(f"source .venv/bin/activate\n{cmd}", cwd, 300)
    assert g.returncode == 0, g.stderr[-3000:]
    assert "/fsdp-scaling/" in (cwd / "PARALLELISM_GUIDE.md").read_text()


def _table_widths(lines: list[str]) -> list[set[int]]:
    """Cell counts of every markdown table's rows (header, delimiter, body), one set per table."""
    tables, cur = [], None
    for line in lines + [""]:
        if line.startswith("|"):
            cur = cur or set()
            cur.add(line.replace("\\|", "").strip().strip("|").count("|") + 1)
        elif cur is not None:
            tables.append(cur)
            cur = None
    return tables


def test_backtest_table_has_one_header_per_row_width():
    """The backtest section's table is a table: its header, delimiter and every row have the same
    cells (the header was once printed twice in one line, 16 cells over 8, which no Markdown
    renderer shows as a table)."""
    from dtrain.costmodel.backtest import backtest
    from dtrain.guide.backtest_section import backtest_section

    widths = _table_widths(backtest_section(backtest(loo=False, rank=False)))
    assert widths == [{8}]
