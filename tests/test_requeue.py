"""Stop on a signal, checkpoint, resume as a requeued attempt: in process, one rank, no Slurm
(the environment variables Slurm sets are set by hand; tests/test_slurm_requeue.py does it for
real)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from omegaconf import OmegaConf

from dtrain.model.gpt import GPTConfig
from dtrain.results.loader import read_jsonl
from dtrain.results.metrics import RunWriter
from dtrain.run import dist as ddist
from dtrain.run import requeue
from dtrain.run.rank import RankContext
from dtrain.train import Callback, Trainer, TrainConfig

TINY = GPTConfig.from_preset("tiny")
SEED = 5


def make_ctx(run_dir) -> RankContext:
    cfg = OmegaConf.create({"seed": SEED, "slurm": {"requeue": True}})
    env = ddist.DistEnv(0, 1, 0, 1, "127.0.0.1", 0)
    return RankContext(cfg, env, torch.device("cpu"), "gloo", run_dir, RunWriter(run_dir))


def train_cfg(**kw) -> TrainConfig:
    base = dict(
        steps=8,
        micro_batch=2,
        strategy="single",
        log_every=0,
        dataset_tokens=20_000,
        warmup_steps=1,
    )
    return TrainConfig(**{**base, **kw})


class SignalAt(Callback):
    """Sends this process `sig` at the end of step `step` (as Slurm would, at any moment)."""

    def __init__(self, step: int, sig=signal.SIGTERM):
        self.step, self.sig = step, sig

    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), self.sig)


class PreRecord(Callback):
    """A record written before training (like fp8-train's layer_precision): must not repeat."""

    def on_train_start(self, trainer):
        trainer.ctx.writer.record("setup", what="written once")


def step_losses(run_dir) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"]) for r in read_jsonl(run_dir / "records.jsonl") if r["kind"] == "step"
    ]


@pytest.fixture
def in_slurm_job(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return monkeypatch


def test_term_mid_run_checkpoints_and_requeued_attempt_matches_uninterrupted(
    tmp_path, in_slurm_job
):
    print(f"seed={SEED}")
    full_dir, run_dir = tmp_path / "full", tmp_path / "run"
    full_dir.mkdir(), run_dir.mkdir()
    Trainer(make_ctx(full_dir), train_cfg(), TINY).run()
    full = step_losses(full_dir)

    first = Trainer(
        make_ctx(run_dir), train_cfg(checkpoint_every=2), TINY, callbacks=[PreRecord(), SignalAt(5)]
    )
    with pytest.raises(SystemExit):
        first.run()
    assert signal.getsignal(signal.SIGTERM) is not first.callbacks[0]._catch  # handlers restored
    # the interrupted attempt got further than its checkpoint: step 5 saved at the start of step 6
    assert [s for s, _ in step_losses(run_dir)] == [1, 2, 3, 4, 5]
    stop = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "preempted"]
    assert stop == [
        {
            "kind": "preempted",
            "rank": 0,
            "step": 5,
            "reason": "terminated",
            "checkpoint": str(run_dir / "checkpoints" / "step-000005"),
            "signal": "TERM",
        }
    ]
    # pretend the attempt also wrote past its checkpoint before dying (SIGKILL after the save)
    with open(run_dir / "records.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 6, "loss": 123.0}\n')

    in_slurm_job.setenv("SLURM_RESTART_COUNT", "1")
    writer = RunWriter(run_dir)
    requeue.start_attempt(run_dir, 0, writer)
    ctx = make_ctx(run_dir)
    second = Trainer(ctx, train_cfg(checkpoint_every=2), TINY, callbacks=[PreRecord()])
    result = second.run()
    writer.close(), ctx.writer.close()
    assert step_losses(run_dir) == full  # every step once, bit-identical losses
    assert [r["kind"] for r in read_jsonl(run_dir / "records.jsonl")].count("setup") == 1
    kinds = [e["kind"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert kinds.index("preempted") < kinds.index("requeued") < kinds.index("resumed")
    assert result["final_loss"] == full[-1][1] and result["steps"] == 8


def test_usr2_hands_over_to_the_previous_handler(tmp_path, in_slurm_job):
    """USR2: after the checkpoint, submitit's handler (here a stand-in) is called, then the rank
    exits."""
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        t = Trainer(make_ctx(tmp_path), train_cfg(), TINY, callbacks=[SignalAt(3, signal.SIGUSR2)])
        with pytest.raises(SystemExit):
            t.run()
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert calls == [signal.SIGUSR2]
    [stop] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "preempted"]
    assert (stop["step"], stop["signal"], stop["reason"]) == (3, "USR2", "preempted")
    assert (tmp_path / "checkpoints" / "step-000003" / ".metadata").is_file()


def test_requeued_attempt_without_checkpoint_restarts_records(tmp_path, in_slurm_job):
    (tmp_path / "records.jsonl").write_text('{"kind": "bench", "x": 1}\n')
    in_slurm_job.setenv("SLURM_RESTART_COUNT", "2")
    with RunWriter(tmp_path) as w:
        requeue.start_attempt(tmp_path, 0, w)
    assert (tmp_path / "records.jsonl").read_text() == ""  # a benchmark simply starts again
    assert read_jsonl(tmp_path / "events.jsonl") == [
        {"kind": "requeued", "rank": 0, "restart_count": 2, "slurm_job_id": "4242"}
    ]


def test_outside_slurm_nothing_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    t = Trainer(make_ctx(tmp_path), train_cfg(steps=2), TINY)
    assert not t.requeue and not any(type(c).__name__ == "StopOnSignal" for c in t.callbacks)
    t.run()
    assert not list(tmp_path.glob(".records-offsets*"))


@pytest.mark.slurm
@pytest.mark.parametrize("requeue_on", [True, False])
def test_slurm_keys_reach_sbatch(requeue_on, slurm_cluster):
    """The executor asks the cluster for its limits (sinfo): it needs one up, not only Slurm
    installed."""
    from pathlib import Path

    from dtrain.core.nodes import BaseConfig, defaults
    from dtrain.run.slurm_launch import slurm_executor

    cfg = defaults(BaseConfig)
    cfg.subproject, cfg.slurm.requeue, cfg.slurm.signal_delay_s, cfg.slurm.max_requeues = (
        "t",
        requeue_on,
        45,
        5,
    )
    ex = slurm_executor(cfg, Path("/tmp/unused"))._executor
    assert ex.parameters["signal_delay_s"] == 45
    assert ex.max_num_timeout == (5 if requeue_on else 0)
    assert ex.parameters["additional_parameters"] == (
        {"requeue": True} if requeue_on else {"no_requeue": True}
    )


def test_usr2_due_before_the_tasks_can_handle_it_is_refused():
    from omegaconf import OmegaConf

    from dtrain.core.errors import UserError
    from dtrain.run.app import check_signal_delay

    check_signal_delay(OmegaConf.create({"time_min": 3, "signal_delay_s": 90}))  # USR2 >= 30 s in
    with pytest.raises(
        UserError,
        match=r"^slurm.time_min=2 must be >= 3 minutes: Slurm sends USR2 .*: "
        r"pass slurm.time_min=3 or more, or lower slurm.signal_delay_s to <= 30$",
    ):
        check_signal_delay(OmegaConf.create({"time_min": 2, "signal_delay_s": 90}))
    with pytest.raises(UserError, match="must be an integer number of seconds >= 1"):
        check_signal_delay(OmegaConf.create({"time_min": 30, "signal_delay_s": 0}))
