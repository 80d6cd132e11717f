"""`python -m fsdp_scaling` end to end (a 2-run sweep), the study report over it, and bad input."""

from __future__ import annotations

import json

import pytest

from omegaconf import OmegaConf

from conftest import py
from dtrain.results import contract, loader
from fsdp_scaling.summary import headline

HEADLINE_KEYS = {
    "strategy",
    "world_size",
    "model_params",
    "flops_per_token",
    "tokens_per_s",
    "step_time_s",
    "tflops_per_rank",
    "mfu",
    "peak_flops",
    "peak_flops_source",
    "overlap_fraction",
    "comm_s",
    "exposed_comm_s",
    "peak_mem_bytes",
    "state_bytes",
    "state_bytes_formula",
    "mixed_precision",
    "device",
    "backend",
    "tp",
    "pp",
    "dp",
    "cp",
    "ep",
    "pp_schedule",
    "breakdown",
}


def composed(config_module: str, overrides: list[str]) -> dict:
    """The config Hydra composes for these overrides (what the app receives), resolved."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module=config_module, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def test_sweep_then_report(tmp_path):
    out = py(
        "-m",
        "fsdp_scaling",
        "-m",
        "train.strategy=ddp,zero3",
        "model.preset=tiny",
        "train.steps=6",
        "train.global_batch=8",
        f"results_dir={tmp_path}",
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = loader.load_runs([tmp_path])
    assert sorted(runs["summary.strategy"]) == ["ddp", "zero3"]
    for run in loader.complete_runs([tmp_path]):
        # config.yaml = the config Hydra composes for this point, as asked: nothing the run derives
        # (device, grad_accum, precision) is written back into it
        point = [
            f"train.strategy={run.config['train']['strategy']}",
            "model.preset=tiny",
            "train.steps=6",
            "train.global_batch=8",
            f"results_dir={tmp_path}",
        ]
        assert run.config == composed("fsdp_scaling.conf", point)
        assert run.config["device"] == "auto" and run.env["device"] == "cpu"
        # derived values are recorded apart: grad_accum = 8 / (micro_batch 2 x dp 2) in the summary
        assert run.config["train"]["grad_accum"] == 1 and run.summary["grad_accum"] == 2
        g = headline(run.summary)
        assert set(g) == HEADLINE_KEYS and "guide" not in run.summary
        assert (
            g["state_bytes"] == g["state_bytes_formula"]
            and g["peak_flops_source"] == "measured cpu matmul probe"
        )
        assert g["world_size"] == 2 and g["backend"] == "gloo" and 0 < g["mfu"] < 1
        assert g["comm_s"] > 0 and 0 <= g["overlap_fraction"] <= 1
        assert (run.path / "steps.png").exists() and (
            run.path / "profile" / "trace.rank0.json.gz"
        ).exists()
        [m] = contract.read(run.summary)  # the typed guide input calibration reads
        assert (m.strategy, m.layout.dp, m.step_time_s, m.mfu) == (
            g["strategy"],
            2,
            g["step_time_s"],
            g["mfu"],
        )
        assert (m.layout.grad_accum, m.precision) == (2, "fp32")  # as the run used them
        assert (
            m.exposed_comm_s == g["exposed_comm_s"]
            and (m.breakdown is None) == (not g["breakdown"])
            and m.recipe is None
        )
    steps = loader.load([tmp_path], kind="step")
    assert len(steps) == 12 and steps["loss"].notna().all()
    assert len(loader.load([tmp_path], kind="overlap")) == 2

    report_dir = tmp_path / "report"
    rep = py("-m", "fsdp_scaling.report", str(tmp_path), "--out", str(report_dir))
    assert rep.returncode == 0, rep.stderr[-2000:]
    summary = json.loads((report_dir / "summary.json").read_text())
    assert summary["subproject"] == "fsdp-scaling" and len(summary["study"]["runs"]) == 2
    # a derived run: names its sources, publishes no copy of their guide inputs
    assert sorted(contract.derived_from(summary, report_dir)) == sorted(
        r.path.resolve() for r in loader.complete_runs([tmp_path]) if r.path != report_dir
    )
    assert contract.read(summary) == []
    for name in (
        "scaling.csv",
        "throughput_vs_ranks.png",
        "efficiency.png",
        "memory_per_strategy.png",
        "overlap.png",
    ):
        assert (report_dir / name).exists(), name
    eff = summary["study"]["scaling_efficiency"]
    assert all(
        v["efficiency"] == [1.0] for v in eff.values()
    )  # one world size: each is its own baseline
    zero3 = next(v for k, v in eff.items() if k.startswith("zero3"))
    ddp_time = runs.loc[runs["summary.strategy"] == "ddp", "summary.step_time_s"].item()
    zero3_time = runs.loc[runs["summary.strategy"] == "zero3", "summary.step_time_s"].item()
    assert zero3["step_time_vs_ddp"][0] == pytest.approx(zero3_time / ddp_time)
    # the report dir is itself a complete run dir, but never mistaken for a training run
    again = py("-m", "fsdp_scaling.report", str(tmp_path), "--out", str(tmp_path / "report2"))
    assert (
        again.returncode == 0
        and json.loads((tmp_path / "report2" / "summary.json").read_text())["runs"] == 2
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.strategy=zero9"], "train.strategy='zero9' is unknown"),
        (["train.strategy=hsdp", "world_size=3"], "do not factor"),
        (["train.global_batch=5"], "not divisible"),
        (["model.preset=huge"], "unknown model preset"),
        (
            ["train.cp=2", "model.preset=tiny", "model.seq_len=66"],
            "model.seq_len=66 is not divisible by 2 x cp = 4",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    out = py("-m", "fsdp_scaling", *args, f"results_dir={tmp_path}", timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert not list(tmp_path.rglob("config.yaml"))  # no run dir left behind


def test_report_without_runs(tmp_path):
    out = py("-m", "fsdp_scaling.report", str(tmp_path))
    assert out.returncode == 2 and "no complete fsdp-scaling training runs" in out.stderr
