"""dtrain.train on one rank, in process: schedule, accumulation, callbacks, checkpoints, config
errors. (Multi-rank strategy equality and cross-world-size resume are in fsdp-scaling/tests.)"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from dtrain.core.errors import UserError
from dtrain.model.gpt import GPTConfig
from dtrain.results.loader import read_jsonl
from dtrain.results.metrics import RunWriter
from dtrain.run import dist as ddist
from dtrain.run.rank import RankContext
from dtrain.train import Callback, Trainer, TrainConfig

TINY = GPTConfig.from_preset("tiny")


def make_ctx(run_dir, seed=0) -> RankContext:
    cfg = OmegaConf.create({"seed": seed})
    env = ddist.DistEnv(0, 1, 0, 1, "127.0.0.1", 0)
    return RankContext(cfg, env, torch.device("cpu"), "gloo", run_dir, RunWriter(run_dir))


def train_cfg(**kw) -> TrainConfig:
    base = dict(
        steps=4,
        micro_batch=2,
        strategy="single",
        log_every=0,
        dataset_tokens=20_000,
        warmup_steps=1,
    )
    return TrainConfig(**{**base, **kw})


def losses(trainer) -> list[float]:
    trainer.run()
    return [
        r["loss"] for r in read_jsonl(trainer.ctx.run_dir / "records.jsonl") if r["kind"] == "step"
    ]


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    big = losses(Trainer(make_ctx(tmp_path / "a"), train_cfg(micro_batch=4), TINY))
    accum = losses(
        Trainer(make_ctx(tmp_path / "b"), train_cfg(micro_batch=1, global_batch=4), TINY)
    )
    assert len(big) == 4 and big == pytest.approx(accum, abs=1e-5)
    assert big[-1] < big[0]  # it learns


def test_lr_schedule_warmup_then_cosine(tmp_path):
    t = Trainer(make_ctx(tmp_path), train_cfg(steps=10, warmup_steps=2, lr=1.0, min_lr=0.1), TINY)
    assert t.scheduled_lr(1) == pytest.approx(0.5) and t.scheduled_lr(2) == pytest.approx(1.0)
    assert t.scheduled_lr(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert t.scheduled_lr(10) == pytest.approx(0.1)


class Recorder(Callback):
    def __init__(self, skip_step=None):
        self.calls, self.skip_step = [], skip_step

    def on_train_start(self, trainer):
        self.calls.append("start")

    def on_step_start(self, trainer, step):
        self.calls.append(("step_start", step))

    def after_backward(self, trainer, step):
        grads = [p.grad for p in trainer.model.parameters()]
        self.calls.append(("after_backward", step, all(g is not None for g in grads)))

    def before_optimizer_step(self, trainer, step, loss, grad_norm):
        self.calls.append(("before_opt", step, math.isfinite(loss) and grad_norm > 0))
        return step != self.skip_step

    def on_step_end(self, trainer, step, metrics):
        metrics["extra"] = step * 10
        self.calls.append(("step_end", step))

    def on_train_end(self, trainer):
        self.calls.append("end")


def test_callbacks_order_skip_and_extra_metrics(tmp_path):
    cb = Recorder(skip_step=2)
    t = Trainer(make_ctx(tmp_path), train_cfg(steps=2), TINY, callbacks=[cb])
    before = [p.detach().clone() for p in t.model.parameters()]
    t.train_step()
    after_one = [p.detach().clone() for p in t.model.parameters()]
    t.train_step()  # skipped by the callback: weights unchanged
    assert all(torch.equal(a, b) for a, b in zip(after_one, t.model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(before, after_one))
    assert cb.calls == [
        ("step_start", 1),
        ("after_backward", 1, True),
        ("before_opt", 1, True),
        ("step_end", 1),
        ("step_start", 2),
        ("after_backward", 2, True),
        ("before_opt", 2, True),
        ("step_end", 2),
    ]
    t.ctx.writer.close()
    records = [r for r in read_jsonl(tmp_path / "records.jsonl") if r["kind"] == "step"]
    assert [r["extra"] for r in records] == [10, 20] and [r["skipped"] for r in records] == [
        False,
        True,
    ]
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "tflops",
        "mfu",
        "step_time_s",
        "peak_mem_bytes",
    ):
        assert key in records[0]
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "skipped_step"] == [2]


def test_checkpoint_resume_gives_identical_losses(tmp_path):
    for d in ("full", "first", "resumed"):
        (tmp_path / d).mkdir()
    full = losses(Trainer(make_ctx(tmp_path / "full"), train_cfg(steps=6), TINY))
    first = Trainer(make_ctx(tmp_path / "first"), train_cfg(steps=6), TINY)
    for _ in range(3):
        first.train_step()
    path = first.save_checkpoint()
    assert path.endswith("step-000003") and first.last_checkpoint == path
    # resume_from a folder of checkpoints takes the latest complete one
    resumed = Trainer(
        make_ctx(tmp_path / "resumed"),
        train_cfg(steps=6, resume_from=str(tmp_path / "first" / "checkpoints")),
        TINY,
    )
    tail = losses(resumed)
    assert resumed.step == 6 and resumed.batcher.step == 6
    assert tail == pytest.approx(full[3:], abs=1e-6)


def test_checkpoint_keeps_lr_scale_and_refuses_other_data(tmp_path):
    t = Trainer(make_ctx(tmp_path), train_cfg(), TINY)
    t.train_step()
    t.lr_scale = 0.25
    path = t.save_checkpoint()
    again = Trainer(make_ctx(tmp_path), train_cfg(), TINY)
    again.load_checkpoint(path)
    assert (again.step, again.lr_scale, again.batcher.step) == (1, 0.25, 1)
    other = Trainer(make_ctx(tmp_path), train_cfg(micro_batch=3), TINY)  # another global batch
    with pytest.raises(UserError, match="global_batch"):
        other.load_checkpoint(path)
    with pytest.raises(UserError, match="no complete checkpoint"):
        other.load_checkpoint(tmp_path / "nowhere")


def test_skip_batch_moves_data_not_step(tmp_path):
    t = Trainer(make_ctx(tmp_path), train_cfg(), TINY)
    t.skip_batch()
    assert (t.step, t.batcher.step, t.batcher.micro_step) == (0, 1, 0)


@pytest.mark.parametrize(
    "kw, world, message",
    [
        (dict(strategy="zero9"), 2, "train.strategy='zero9' is unknown"),
        (dict(strategy="hsdp", hsdp_replicate=2), 3, "do not factor"),
        (dict(strategy="ddp", micro_batch=3, global_batch=8), 2, "not divisible"),
        (dict(strategy="single"), 2, "runs on one rank"),
        (
            dict(precision="fp16"),
            1,
            "train.precision='fp16' is unknown: choose one of fp32, bf16, auto",
        ),
    ],
)
def test_config_errors(kw, world, message):
    with pytest.raises(UserError, match=message):
        TrainConfig(**kw).validate(world)


def test_config_from_cfg_rejects_unknown_key_and_derives_accum():
    with pytest.raises(
        UserError,
        match=r"^unknown key train.stpes: did you mean train.steps\? \(all keys: --cfg job\)$",
    ):
        TrainConfig.from_cfg(OmegaConf.create({"stpes": 3}))
    asked = TrainConfig.from_cfg(
        OmegaConf.create({"micro_batch": 2, "global_batch": 16, "precision": "auto"})
    )
    before = asked.to_dict()
    asked.validate(4)
    t = asked.resolved(4, "cpu")
    assert asked.to_dict() == before  # validate and resolved leave the asked config as it was
    assert t.grad_accum == 2 and t.global_batch_for(4) == 16 and t.precision == "fp32"
    assert asked.resolved(4, "cuda").precision == "bf16" and asked.resolved(4).precision == "auto"


def test_clip_grad_norm_is_torchs_on_one_rank():
    """The trainer's one clipping (dtrain.train.parallel_model.clip_grad_norm) against torch's
    clip_grad_norm_ on plain tensors: same norm, same clipped gradients (the multi-rank layouts'
    norms are checked against the single-process run in tests/test_train_layouts.py)."""
    from dtrain.train.parallel_model import clip_grad_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    mine = clip_grad_norm(grads, 0.5, world_size=1, pp=1, device=torch.device("cpu"))
    theirs = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    assert mine == pytest.approx(theirs, rel=1e-6) and mine > 0.5
    for g, p in zip(grads, params):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)
    assert math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params)) == pytest.approx(
        0.5, rel=1e-5
    )
