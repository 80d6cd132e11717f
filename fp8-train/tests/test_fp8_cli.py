"""End to end through `python -m fp8_train`: a 2-rank run and its guide, inspect, dashboard, bad
input, and fault injection climbing the recovery ladder."""

import json
from pathlib import Path

import pytest
from conftest import py

from dtrain.model.gpt import GPTConfig, num_params
from dtrain.results import contract, contract_records
from dtrain.results.loader import find_runs, load, load_events, read_jsonl

SUMMARY_KEYS = {
    "recipe",
    "precision",
    "tokens_per_s",
    "peak_mem_bytes",
    "final_loss",
    "nan_events",
    "high_precision_layers",
    "device",
    "backend",
}
QUIET = ["health.tensorboard=false", "train.log_every=0"]


def _only_run(root: Path) -> Path:
    runs = find_runs([root])
    assert len(runs) == 1 and runs[0].status == "complete", [
        (r.path, r.status, r.reason) for r in runs
    ]
    return runs[0].path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8run")
    r = py(
        "-m",
        "fp8_train",
        f"results_dir={root}",
        "train.steps=12",
        "fp8_debug.freq=5",
        *QUIET,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return _only_run(root), r


def test_run_writes_guide_debug_records_and_dashboard(trained):
    run, _ = trained
    summary = json.loads((run / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary) and "guide" not in summary
    g = summary
    assert g["recipe"] == "emulated_delayed" and g["precision"] == "fp32" and g["device"] == "cpu"
    assert (
        g["backend"] == "gloo" and g["nan_events"] == 0 and g["final_loss"] < 5.6
    )  # ln(256) = 5.55 at init
    assert {"tok_emb", "pos_emb", "lm_head"} <= set(g["high_precision_layers"])
    [m] = contract.read(summary)  # the typed guide input, as calibration reads it
    assert isinstance(m, contract_records.TrainingMeasurement) and (m.recipe, m.precision) == (
        "emulated_delayed",
        "fp32",
    )
    assert (
        m.tokens_per_s == g["tokens_per_s"] and m.layout.world_size == 2 and m.where.device == "cpu"
    )
    debug = load([run], kind="fp8_debug")
    assert set(debug["step"]) == {5, 10}
    assert set(debug["tensor"]) == {"activation", "weight", "gradient"} and set(
        debug["recipe"]
    ) == {"delayed", "current"}
    assert ((debug["cos_sim"] > 0.9) & (debug["cos_sim"] <= 1.0 + 1e-9)).all()
    steps = load([run], kind="step")
    assert {"param_norm", "update_ratio", "grad_snr", "fp8_scale_min"} <= set(steps.columns)
    assert (run / "dashboard.png").stat().st_size > 10_000 and "<img" in (
        run / "dashboard.html"
    ).read_text()


def test_inspect_and_dashboard_commands(trained, tmp_path):
    run, _ = trained
    r = py("-m", "fp8_train", "inspect", str(run), "overflow_bad_pct=0.5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "worst layers" in r.stdout and "layer(s) bad" in r.stdout and "overflow 0.5%" in r.stdout
    r = py("-m", "fp8_train", "inspect", str(run), "bogus=1")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: inspect option 'bogus=1'")
    r = py("-m", "fp8_train", "dashboard", str(run), "--out", str(tmp_path))
    assert (
        r.returncode == 0
        and (tmp_path / "dashboard.png").exists()
        and (tmp_path / "dashboard.html").exists()
    )


def test_te_without_transformer_engine_or_cuda_is_one_line(tmp_path):
    r = py("-m", "fp8_train", "recipe=te_delayed", f"results_dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: recipe=te_delayed uses TransformerEngine, which needs a CUDA GPU (none here): "
        "use recipe=emulated_delayed or torchao_tensorwise on CPU"
    ]
    assert not any(tmp_path.rglob("config.yaml"))  # bad input leaves no run behind


def test_bad_fault_layer_is_one_line(tmp_path):
    r = py(
        "-m", "fp8_train", f"results_dir={tmp_path}", "faults=[{step: 3, layer: blocks.9.mlp.w1}]"
    )
    assert r.returncode == 2 and "faults[0].layer='blocks.9.mlp.w1' is not a module" in r.stderr


FAULT = "faults=[{step: 5, layer: blocks.1.mlp.w2, tensor: activation, kind: inf, repeat: 3}]"


def _train(root: Path, *overrides: str) -> Path:
    r = py(
        "-m",
        "fp8_train",
        f"results_dir={root}",
        "fp8_debug.enabled=false",
        "guard.checkpoint_every=3",
        *QUIET,
        *overrides,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return _only_run(root)


@pytest.mark.slow  # the fast path keeps a shorter test of the same property
def test_injected_inf_climbs_the_ladder_on_every_rank(tmp_path):
    run = _train(tmp_path, "train.steps=14", FAULT)
    events = load_events([run])
    for rank in (0, 1):  # the loss is all-reduced: rank 1 climbs the same rungs at the same steps
        mine = events[events["rank"] == rank]
        actions = list(mine.loc[mine["kind"] == "recovery", "action"])
        assert actions[:6] == [
            "skip_step",
            "skip_step",
            "lr_cut",
            "skip_step",
            "rollback",
            "layer_to_high_precision",
        ]
        assert list(mine.loc[mine["kind"] == "nonfinite", "step"]) == [5, 6, 7]
    nonfinite = events[(events["kind"] == "nonfinite") & (events["rank"] == 0)]
    assert set(nonfinite["first_nonfinite_activation"]) == {
        "blocks.1.mlp.w2"
    }  # the fault fires on rank 0 only
    assert (
        events.loc[
            (events["kind"] == "nonfinite") & (events["rank"] == 1), "first_nonfinite_activation"
        ]
        .isna()
        .all()
    )
    rollback = events[(events["action"] == "rollback") & (events["rank"] == 0)].iloc[0]
    assert rollback["to_step"] == 3 and rollback["skip_data_positions"] == [4, 5, 6]
    skipped = events[(events["kind"] == "skip_batch") & (events["rank"] == 0)]
    assert list(skipped["data_position"]) == [4, 5, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nan_events"] == 3 and summary["rollbacks"] == 1
    assert "blocks.1.mlp.w2" in summary["high_precision_layers"]
    steps = load([run], kind="step").drop_duplicates("step", keep="last")
    assert steps["step"].max() == 14 and steps["loss"].notna().all()


@pytest.mark.slow
def test_recovered_run_ends_within_noise_of_the_clean_run(tmp_path):
    # 80 steps: a recovery costs a few half-LR steps, which at 40 steps (loss still falling 0.05 per
    # step) is a visible lag; nearer convergence it must vanish into the noise.
    faulted = _train(tmp_path / "fault", "train.steps=80", FAULT)
    clean = _train(tmp_path / "clean", "train.steps=80")
    loss = [json.loads((r / "summary.json").read_text())["final_loss"] for r in (faulted, clean)]
    events = load_events([faulted])
    assert "lr_restore" in set(events["action"].dropna())
    # Seed std of the default config's final loss is ~0.04 (3 seeds, README "Results"): 0.1 is ~2.5
    # sigma.
    assert abs(loss[0] - loss[1]) < 0.1, loss


@pytest.mark.slow
def test_compare_writes_report_and_guide(tmp_path):
    r = py(
        "-m",
        "fp8_train",
        "compare",
        "--recipes",
        "fp32,emulated_current",
        "--seeds",
        "0,1",
        f"results_dir={tmp_path}",
        "world_size=1",
        "train.strategy=single",
        "train.steps=6",
        "fp8_debug.enabled=false",
        *QUIET,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = next((tmp_path / "fp8-train").glob("compare-*"))
    summary = json.loads((out / "summary.json").read_text())
    [rec] = contract.read(summary)  # one comparison per FP8 recipe
    assert isinstance(rec, contract_records.Fp8Comparison) and (rec.recipe, rec.baseline) == (
        "emulated_current",
        "fp32",
    )
    assert rec.emulated is True and rec.seeds == 2 and rec.where.device == "cpu"
    assert "lm_head" in rec.keep_high_precision
    report = (out / "report.md").read_text()
    assert (
        "Within noise: |mean_r - mean_fp32| <= 2 x std_fp32" in report
        and (out / "loss_curves.png").exists()
    )
    sources = find_runs([out / "runs"])
    assert len(sources) == 4 and sorted(contract.derived_from(summary, out)) == sorted(
        r.path.resolve() for r in sources
    )


@pytest.mark.slow  # the fast path keeps a shorter test of the same property
def test_the_gpu_default_recipe_trains_in_bf16_from_the_command_line(tmp_path):
    """On a GPU train.precision=auto resolves to bf16: the emulated recipe must train under CPU bf16
    autocast too (it once failed in backward with `BFloat16 != float`). A model field as the
    README writes it."""
    r = py(
        "-m",
        "fp8_train",
        "recipe=emulated_delayed",
        "train.precision=bf16",
        "train.strategy=single",
        "world_size=1",
        "train.steps=4",
        "model.n_layer=3",
        f"results_dir={tmp_path}",
        *QUIET,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run = _only_run(tmp_path)
    losses = list(load([run], kind="step")["loss"])
    assert len(losses) == 4 and all(v == v for v in losses) and losses[-1] < losses[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == "bf16" and contract.read(summary)[0].precision == "bf16"
    assert summary["model_params"] == num_params(GPTConfig.from_preset("tiny", n_layer=3))


@pytest.mark.slow  # the fast path keeps a shorter test of the same property
def test_delayed_scaling_resumes_exactly_on_two_ranks(tmp_path):
    """Delayed scaling's amax history is per rank unless reduced (TE reduces it over the
    data-parallel group); a DCP checkpoint holds one rank's copy, so without the reduction a
    2-rank resume drifted (1.5e-4 at the first resumed step). With it, the resumed losses equal
    the uninterrupted run's."""
    quiet = [
        *QUIET,
        "fp8_debug.enabled=false",
        "health.enabled=false",
        "guard.enabled=false",
        "recipe=emulated_delayed",
        "world_size=2",
        "train.steps=4",
    ]
    full = py(
        "-m",
        "fp8_train",
        f"results_dir={tmp_path / 'full'}",
        "train.checkpoint_every=2",
        *quiet,
        timeout=180,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    run = _only_run(tmp_path / "full")
    again = py(
        "-m",
        "fp8_train",
        f"results_dir={tmp_path / 'resumed'}",
        f"train.resume_from={run / 'checkpoints' / 'step-000002'}",
        *quiet,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    loss = {
        name: {
            r["step"]: r["loss"]
            for r in read_jsonl(_only_run(tmp_path / name) / "records.jsonl")
            if r.get("kind") == "step"
        }
        for name in ("full", "resumed")
    }
    print("losses", loss)
    assert sorted(loss["resumed"]) == [3, 4]
    assert [loss["resumed"][s] for s in (3, 4)] == [loss["full"][s] for s in (3, 4)]  # bit-equal
