"""The run-directory contract: write, load back, skip what is incomplete or corrupt."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dtrain.results import loader
from dtrain.results.metrics import RunWriter, write_config, write_json_atomic, write_summary


def make_run(
    path, cfg: dict, records: list[dict], summary: dict | None = None, rank1: list[dict] = ()
):
    path.mkdir(parents=True)
    write_config(path, OmegaConf.create(cfg))
    write_json_atomic(
        path / "env.json", {"world_size": cfg.get("world_size", 1), "backend": "gloo"}
    )
    with RunWriter(path, 0) as w:
        for r in records:
            w.record(**r)
        w.event("alert", step=3, message="grad-norm spike")
    with RunWriter(path, 1, per_rank_records=True) as w:
        for r in rank1:
            w.record(**r)
    if summary is not None:
        write_summary(path, summary)
    return path


def test_round_trip_and_flattened_config(tmp_path):
    make_run(
        tmp_path / "a",
        {"subproject": "x", "world_size": 2, "model": {"n_layer": 2}},
        [{"kind": "step", "step": 0, "loss": 5.0}, {"kind": "step", "step": 1, "loss": 4.0}],
        {"final_loss": 4.0},
        rank1=[{"kind": "step", "step": 0, "loss": 5.5, "rank": 1}],
    )
    df = loader.load([tmp_path], kind="step")
    assert sorted(df["loss"]) == [4.0, 5.0, 5.5]
    assert set(df["model.n_layer"]) == {2} and set(df["world_size"]) == {2}
    runs = loader.load_runs([tmp_path])
    assert runs.loc[0, "summary.final_loss"] == 4.0 and runs.loc[0, "env.backend"] == "gloo"
    events = loader.load_events([tmp_path])
    assert events.loc[0, "kind"] == "alert" and events.loc[0, "rank"] == 0


def test_record_field_wins_over_config_field(tmp_path):
    make_run(tmp_path / "a", {"size": 7}, [{"kind": "m", "size": 1024}], {})
    df = loader.load([tmp_path])
    assert df.loc[0, "size"] == 1024 and df.loc[0, "config.size"] == 7


def test_incomplete_and_corrupt_runs_are_skipped_with_named_warning(tmp_path):
    make_run(tmp_path / "good", {"subproject": "x"}, [{"kind": "m", "v": 1}], {"ok": True})
    make_run(tmp_path / "half", {"subproject": "x"}, [{"kind": "m", "v": 2}], None)
    bad = make_run(tmp_path / "bad", {"subproject": "x"}, [{"kind": "m", "v": 3}], {"ok": True})
    with open(bad / "records.jsonl", "a") as f:
        f.write('{"kind": "m", "v": \n')
    torn = make_run(tmp_path / "torn", {"subproject": "x"}, [], {"ok": True})
    (torn / "summary.json").write_text('{"ok": tru')
    with pytest.warns(UserWarning) as caught:
        df = loader.load([tmp_path])
    assert list(df["v"]) == [1]
    text = " ".join(str(w.message) for w in caught)
    assert "half" in text and "no summary.json" in text and "bad" in text and "torn" in text
    statuses = {r.path.name: r.status for r in loader.find_runs([tmp_path])}
    assert statuses == {
        "good": "complete",
        "half": "incomplete",
        "bad": "corrupt",
        "torn": "corrupt",
    }


def test_multirun_tree_and_hydra_copies(tmp_path):
    sweep = tmp_path / "sub" / "multirun-1"
    for i in range(3):
        run = make_run(
            sweep / str(i), {"subproject": "sub", "lr": i}, [{"kind": "m", "v": i}], {"i": i}
        )
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("lr: 99\n")
    (sweep / "multirun.yaml").write_text("x: 1\n")
    runs = loader.load_runs([tmp_path])
    assert sorted(runs["lr"]) == [0, 1, 2] and sorted(runs["summary.i"]) == [0, 1, 2]


def test_summary_written_atomically(tmp_path):
    write_summary(tmp_path, {"a": 1})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no tmp file left


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such results path"):
        loader.find_runs([tmp_path / "nope"])


def test_runs_cli(tmp_path, capsys):
    from dtrain.cli.main import main

    make_run(tmp_path / "good", {"subproject": "alpha"}, [], {"ok": True})
    make_run(tmp_path / "half", {"subproject": "alpha"}, [], None)
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "complete" in out and "1 incomplete/corrupt run(s) hidden" in out
    assert main(["runs", str(tmp_path / "nope")]) == 2


def test_derived_runs_are_flagged(tmp_path):
    """A run made from runs (dtrain.results.derived) carries Run.derived (and load_runs'
    `derived` column); the runs it was made from do not."""
    from dtrain.results.derived import write_derived_run

    src = make_run(
        tmp_path / "measured",
        {"subproject": "x"},
        [{"kind": "step", "step": 1}],
        {"final_loss": 4.0},
    )
    write_derived_run(
        tmp_path / "report", "x", [src], config={"report": True}, summary={"study": {}}
    )
    flags = {r.path.name: r.derived for r in loader.complete_runs([tmp_path])}
    assert flags == {"measured": False, "report": True}
    runs = loader.load_runs([tmp_path])
    assert dict(zip(runs["run"].map(lambda p: p.rsplit("/", 1)[-1]), runs["derived"])) == flags


def test_files_named_skips_a_folder_that_vanishes_mid_walk(tmp_path, monkeypatch):
    """A live results tree: a folder listed by its parent is gone before the walk enters it.
    Path.rglob raises there; files_named finds every file that is still present."""
    import os

    from dtrain.core.files import files_named

    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    for p in ("run/config.yaml", "run/.hydra/config.yaml", "gone/config.yaml", "run/events.jsonl"):
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text("x")
    real_scandir = os.scandir

    def scandir(path="."):
        if str(path).endswith("gone"):  # listed by tmp_path, removed before it is entered
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(FileNotFoundError):
        list(tmp_path.rglob("config.yaml"))
    assert files_named(tmp_path, "config.yaml") == [
        tmp_path / "run/.hydra/config.yaml",
        tmp_path / "run/config.yaml",
    ]
    assert files_named(tmp_path, ".hydra/config.yaml") == [tmp_path / "run/.hydra/config.yaml"]
