"""TensorBoard event files beside records.jsonl (dtrain.results.metrics.RunWriter.scalar): what
the trainer records per step is read back with TensorBoard's own reader and equals the records,
step by step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dtrain.model.gpt import GPTConfig
from dtrain.results.loader import read_jsonl
from dtrain.results.metrics import RunWriter, run_name
from dtrain.run import dist as ddist
from dtrain.run.rank import RankContext
from dtrain.train import Trainer, TrainConfig
from dtrain.train.train_metrics import SCALARS

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
ROOT = Path(__file__).resolve().parents[1]
SEED = 0


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_folders(run_dir: Path) -> list[Path]:
    return sorted({p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")})


def as_f32(pairs) -> list[tuple[int, np.float32]]:
    """Event files store scalars as float32."""
    return [(step, np.float32(v)) for step, v in pairs]


def tiny_run(run_dir: Path, overrides: list[str]) -> None:
    """A 4-step trainer run in process, in a run dir whose Hydra overrides are `overrides`."""
    print(f"seed {SEED}")
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    ctx = RankContext(
        OmegaConf.create({"seed": SEED}),
        ddist.DistEnv(0, 1, 0, 1, "127.0.0.1", 0),
        torch.device("cpu"),
        "gloo",
        run_dir,
        RunWriter(run_dir),
    )
    train = TrainConfig(
        steps=4, micro_batch=2, strategy="single", log_every=0, dataset_tokens=20_000
    )
    with ctx.writer:
        Trainer(ctx, train, GPTConfig.from_preset("tiny")).run()


def test_trainer_scalars_equal_the_records_step_by_step(tmp_path):
    run = tmp_path / "run"
    tiny_run(
        run,
        [
            "model.preset=tiny",
            "train.strategy=single",
            "results_dir=/tmp/r",
            "hydra.sweep.dir=/tmp/s",
        ],
    )
    (folder,) = event_folders(run)
    # named by what the run changed; where it is written (results_dir, hydra.*) left out
    assert folder == run / "tb" / "model.preset=tiny,train.strategy=single"
    steps = [r for r in read_jsonl(run / "records.jsonl") if r["kind"] == "step"]
    scalars = read_scalars(folder)
    assert sorted(scalars) == sorted(f"train/{k}" for k in SCALARS)
    for key in SCALARS:
        assert scalars[f"train/{key}"] == as_f32((r["step"], r[key]) for r in steps), key
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]


def test_a_restarted_run_replaces_the_steps_it_repeats(tmp_path):
    """A requeued attempt starts again at its checkpoint's step: TensorBoard drops what the earlier
    attempt wrote from there (purge_step), as the records are cut back."""
    with RunWriter(tmp_path) as w:
        for step in range(1, 6):
            w.scalar("train/loss", float(step), step)
    with RunWriter(tmp_path) as w:
        for step in (3, 4):
            w.scalar("train/loss", 10.0 + step, step)
    (folder,) = event_folders(tmp_path)
    assert folder.name == "defaults"  # no Hydra overrides (a derived run, a test)
    assert read_scalars(folder)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_only_rank_0_and_only_finite_numbers(tmp_path):
    with RunWriter(tmp_path, rank=1) as w:
        w.scalar("x", 1.0, 1)
    assert not (tmp_path / "tb").exists()
    with RunWriter(tmp_path) as w:
        w.scalars("g", 1, a=1.5, b=None, c=float("nan"), d=True, e="text", f=3)
    assert read_scalars(event_folders(tmp_path)[0]) == {"g/a": [(1, 1.5)], "g/f": [(1, 3.0)]}


def test_without_tensorboard_one_event_and_no_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if missing
    with RunWriter(tmp_path) as w:
        w.scalar("a", 1.0, 1)
        w.scalar("a", 2.0, 2)
        w.record("step", step=1)
    assert not (tmp_path / "tb").exists()
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events] == ["tensorboard_unavailable"]
    assert events[0]["reason"].endswith("pip install -e '.[dashboard]'")
    assert [r["kind"] for r in read_jsonl(tmp_path / "records.jsonl")] == ["step"]


def test_a_run_that_records_no_scalar_imports_no_tensorboard(tmp_path):
    code = (
        "import sys; from dtrain.results.metrics import RunWriter\n"
        f"w = RunWriter({str(tmp_path)!r}); w.record('x', v=1); w.event('y'); w.close()\n"
        "print(json.dumps(sorted(m for m in sys.modules if 'tensorboard' in m)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [] and not (tmp_path / "tb").exists()


def test_run_name_is_the_overrides_clipped_to_a_file_name(tmp_path):
    (tmp_path / ".hydra").mkdir()
    overrides = ["+x=a/b", "hydra/launcher=submitit_slurm", "~y"] + [f"k{i}=v" for i in range(40)]
    (tmp_path / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))  # YAML reads JSON
    name = run_name(tmp_path)
    assert name.startswith(f"+x=a{'%' if os.sep == '/' else os.sep}b,~y,k0=v,") and len(name) == 120
    assert run_name(tmp_path) == name  # the same name again: a requeued run continues its folder


@pytest.mark.slow
def test_a_sweep_names_each_point_by_its_overrides(tmp_path):
    """`tensorboard --logdir results` tells sweep points apart: each point's events folder is named
    by its own overrides (end to end, through Hydra)."""
    cmd = [
        sys.executable,
        "-m",
        "fsdp_scaling",
        "-m",
        "model.preset=tiny",
        "train.steps=3",
        "train.timing_warmup=1",
        "profile.enabled=false",
        "world_size=1",
        "train.strategy=single,ddp",
        f"results_dir={tmp_path}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    names = sorted(f.name for f in tmp_path.glob("fsdp-scaling/multirun-*/*/tb/*"))
    assert names == [
        f"model.preset=tiny,train.steps=3,train.timing_warmup=1,profile.enabled=False,"
        f"world_size=1,train.strategy={s}"
        for s in ("ddp", "single")
    ]
    for point in tmp_path.glob("fsdp-scaling/multirun-*/*/"):
        records = read_jsonl(point / "records.jsonl")
        losses = [(r["step"], r["loss"]) for r in records if r["kind"] == "step"]
        assert read_scalars(event_folders(point)[0])["train/loss"] == as_f32(losses)


@pytest.mark.slow
def test_benchmarks_main_numbers_in_tensorboard(tmp_path):
    """allreduce-bench: busbw per message size (x = bytes), one curve per case; tp-attention: each
    implementation's median step time per SP setting (x = tp). Equal to their records."""
    small = [
        "min_bytes=1K",
        "max_bytes=64K",
        "step_factor=8",
        "iters=3",
        "timing_warmup=1",
        "collectives=[all_reduce]",
        "dtypes=[float32]",
    ]
    subprocess.run(
        [sys.executable, "-m", "allreduce_bench", f"results_dir={tmp_path}", *small],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (run,) = tmp_path.glob("allreduce-bench/*/")
    records = [r for r in read_jsonl(run / "records.jsonl") if r["kind"] == "collective"]
    scalars = read_scalars(event_folders(run)[0])
    for r in records:
        tag = f"busbw_GBps/{r['link_class']}/{r['collective']}/{r['dtype']}/{r['mode']}"
        assert (r["nbytes"], np.float32(r["busbw_GBps"])) in as_f32(scalars[tag]), tag
    assert sum(map(len, scalars.values())) == len(records) > 0

    tiny = [
        "train.micro_batch=1",
        "model.seq_len=16",
        "model.d_model=32",
        "model.n_head=4",
        "timing_warmup=1",
        "iters=2",
        "profile.steps=1",
    ]
    subprocess.run(
        [sys.executable, "-m", "tp_attention", f"results_dir={tmp_path}", *tiny],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (run,) = tmp_path.glob("tp-attention/*/")
    scalars = read_scalars(event_folders(run)[0])
    steps = [
        r
        for r in read_jsonl(run / "records.jsonl")
        if r["kind"] == "step" and r["impl"] in ("handrolled", "handrolled_async", "dtensor")
    ]
    assert len(steps) == sum(map(len, scalars.values())) > 0
    for r in steps:
        tag = f"step_time_s/{r['impl']}/sp_{'on' if r['sequence_parallel'] else 'off'}"
        assert scalars[tag] == as_f32([(r["tp"], r["median_s"])]), tag
