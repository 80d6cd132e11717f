"""One guide from the same inputs whichever command makes it (issue 40): `dtrain guide` without
--results reads what the latest `dtrain capstone` gave its guide (its own runs and measured/), so
`make guide` and the capstone give the same cells."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dtrain.cli import capstone
from dtrain.cli.main import main
from dtrain.guide import inputs as guide_inputs

FIXTURES = Path(__file__).parent / "fixtures" / "results"


def _capstone_inputs(monkeypatch, results: str) -> list[str]:
    """`dtrain capstone` (one trivial step, the probe stubbed): what it gave its guide."""
    from dtrain.costmodel import gemm_probe
    from dtrain.guide import guide_cli

    seen = []

    def generate(inputs, out, quiet):
        seen.append(list(inputs))
        return Path(out), []

    step = capstone.Step("first", "this", (), module="this", needs_launcher=False)
    monkeypatch.setattr(capstone, "STEPS", (step,))
    monkeypatch.setattr(gemm_probe, "probe", lambda results: results / "gemm-probe")
    monkeypatch.setattr(guide_cli, "generate", generate)
    assert main(["capstone", "--results-dir", results, "--out", "G.md"]) == 0
    return seen[0]


def _guide_inputs(monkeypatch) -> list[str]:
    """What plain `dtrain guide` (make guide) reads."""
    from dtrain.guide import guide_cli

    seen = []
    monkeypatch.setattr(
        guide_cli, "generate", lambda inputs, out, plots_dir, gpu: seen.append(list(inputs))
    )
    assert main(["guide", "--out", "G.md"]) == 0
    return seen[0]


def test_plain_guide_reads_what_the_latest_capstone_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "measured").mkdir()
    given = _capstone_inputs(monkeypatch, "results/capstone/20990101-000000-000000")
    assert given == ["results/capstone/20990101-000000-000000", "measured"]
    capsys.readouterr()
    assert _guide_inputs(monkeypatch) == given
    err = capsys.readouterr().err
    said = " ".join(err.split())
    assert (
        "guide: reading the latest capstone, results/capstone/20990101-000000-000000 and "
        "measured, as `dtrain capstone` did (--results DIR to choose)" in said
    )
    # a later capstone that stopped before its guide (no guide-inputs.json) is not "the latest"
    (tmp_path / "results" / "capstone" / "20990102-000000-000000" / "logs").mkdir(parents=True)
    assert _guide_inputs(monkeypatch) == given


def test_measured_none_is_recorded_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "measured").mkdir()
    folder = Path("results/capstone/20990101-000000-000000")
    folder.mkdir(parents=True)
    assert guide_inputs.record(folder, []) == [str(folder)]
    assert guide_inputs.default_inputs()[0] == [str(folder)]


def test_without_a_capstone_the_guide_reads_results_and_measured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert guide_inputs.default_inputs()[0] == ["results"]  # a checkout without measured/
    (tmp_path / "measured").mkdir()
    inputs, said = guide_inputs.default_inputs()
    assert inputs == ["results", "measured"]
    assert said == (
        "guide: no capstone under results/capstone: reading results and measured "
        "(--results DIR to choose)"
    )


def test_recorded_measurements_survive_a_moved_checkout(tmp_path, monkeypatch):
    """The record holds paths relative to the capstone's folder: read from another cwd or after the
    checkout moved, it still names the same measurements."""
    old = tmp_path / "old"
    (old / "measured").mkdir(parents=True)
    folder = old / "results" / "capstone" / "20990101-000000-000000"
    folder.mkdir(parents=True)
    monkeypatch.chdir(old)
    guide_inputs.record(Path("results/capstone/20990101-000000-000000"), ["measured"])
    shutil.move(str(old), str(tmp_path / "new"))
    moved = tmp_path / "new" / "results" / "capstone" / "20990101-000000-000000"
    assert guide_inputs.recorded(moved) == [str(moved), str(tmp_path / "new" / "measured")]


def test_a_damaged_record_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "results" / "capstone" / "20990101-000000-000000"
    folder.mkdir(parents=True)
    (folder / guide_inputs.INPUTS_FILE).write_text("{not json")
    assert main(["guide", "--out", "G.md"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[-1].startswith(
        "error: results/capstone/20990101-000000-000000/guide-inputs.json: unreadable ("
    )
    assert err[-1].endswith("): pass --results DIR")
    assert not (tmp_path / "G.md").exists()


@pytest.mark.slow
def test_make_guide_and_the_capstone_write_the_same_guide(tmp_path, monkeypatch):
    """The guide text from the default inputs equals the one from the capstone's explicit inputs
    (the fixture runs as a capstone's folder, the fixture GPU runs as measured/); two guides,
    ~30 s on 2 cores."""
    from dtrain.guide.guide_cli import generate

    monkeypatch.chdir(tmp_path)
    folder = Path("results/capstone/20990101-000000-000000")
    shutil.copytree(FIXTURES / "cpu", folder)
    shutil.copytree(FIXTURES / "gpu", "measured")
    explicit = guide_inputs.record(folder, guide_inputs.gpu_measurements("measured"))
    assert explicit == [str(folder), "measured"]
    capstone_guide, _ = generate(explicit, "a/G.md", quiet=True)
    assert main(["guide", "--out", "b/G.md"]) == 0
    text = capstone_guide.read_text()
    assert "No GPU results" not in text
    assert Path("b/G.md").read_text() == text
