"""The training loop shared by fsdp-scaling and fp8-train.

One optimizer step = `grad_accum` micro-steps of forward + backward on this rank's slice of the
global batch (dtrain.train.data.TokenBatcher: the data of a step depends only on seed, step and
global batch, never on the world size), then grad-norm clipping and AdamW. Loss and grad norm are
global (averaged / computed across data-parallel ranks), so every rank sees the same numbers and
can take the same decision (skip a step, cut the LR, roll back).

Every layout takes one path: the rank layout is a dtrain.parallel.mesh.ParallelDims, and
dtrain.train.parallelize turns the GPT into the ParallelModel this loop drives (its parts, one
loss reduction, one DTensor-aware clipping). Each data-parallel replica is tp x pp x cp ranks that
read the same batch (cp ranks each train on their shard of its sequences), and a step's
micro-batches run as gradient accumulation (pp = 1) or as one pipeline-schedule step (pp > 1).

Extension points: `linear_factory` (which linear class each layer uses), `autocast` (a context
around forward), `grad_scaler` (fp16), and `Callback`s (see callbacks.py).
What a step and a run report (their metrics, MFU's peak): train_metrics.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from dtrain.core.errors import UserError
from dtrain.model import perf
from dtrain.model.gpt import GPT, GPTConfig, flops_per_token, num_params
from dtrain.model.timing import Stopwatch
from dtrain.results.metrics import finite_or_none
from dtrain.run import requeue
from dtrain.train import checkpoint, checkpoint_folders, preemption
from dtrain.train.callbacks import Callback
from dtrain.train.config import TrainConfig
from dtrain.train.data import TokenBatcher, make_dataset
from dtrain.train.moe_metrics import MoEMetrics
from dtrain.train.parallel_model import OptimizerParts
from dtrain.train.parallelize import parallelize
from dtrain.train.train_metrics import (
    SCALARS,
    agreed_peak_flops,
    final_metrics,
    require_finite_end,
    step_metrics,
)


class Trainer:
    def __init__(
        self,
        ctx,
        train: TrainConfig,
        model_cfg: GPTConfig,
        *,
        linear_factory=None,
        autocast: Callable[[], ContextManager] | None = None,
        grad_scaler=None,
        callbacks: Sequence[Callback] = (),
        peak_flops: tuple[float, str] | None = None,
    ):
        self.ctx, self.model_cfg = ctx, model_cfg
        self.train = train.resolved(
            ctx.world_size, ctx.device.type
        )  # the caller's config is left as asked
        self.train.validate_model(model_cfg)
        train = self.train
        self.device, self.world_size = ctx.device, ctx.world_size
        self.dims = train.dims(ctx.world_size)
        if self.dims.model_parallel and grad_scaler is not None:
            raise UserError(
                "a grad scaler (fp16) is not supported with train.tp / train.pp > 1: use bf16 or "
                "fp32"
            )
        self.callbacks = list(callbacks)
        self.requeue = requeue.enabled(
            ctx.cfg
        )  # inside a Slurm job: stop, checkpoint and requeue on a signal
        if self.requeue:  # first, so a stop happens before any other callback acts on the step
            self.callbacks.insert(0, preemption.StopOnSignal())
        self.grad_scaler = grad_scaler
        self.step = 0  # optimizer steps completed
        self.lr_scale = 1.0  # multiplier on the scheduled LR (a callback may cut it)
        self.last_checkpoint = None
        self.pinned: set[str] = (
            set()
        )  # checkpoints `prune` must keep (the NaN guard's rollback target)
        self.step_times: list[float] = []
        self._recorded = 0  # last step whose record is written
        self._offset_due = None  # step of a checkpoint whose records offset is still to note

        data = make_dataset(
            train.dataset,
            num_tokens=train.dataset_tokens,
            vocab_size=model_cfg.vocab_size,
            seed=ctx.cfg.seed,
        )
        if data.vocab_size > model_cfg.vocab_size:
            raise UserError(
                f"dataset {train.dataset!r} has vocab {data.vocab_size} > model vocab_size="
                f"{model_cfg.vocab_size}: raise model.vocab_size"
            )
        torch.manual_seed(ctx.cfg.seed)  # same initial weights on every rank and every layout
        self.parallel = parallelize(GPT(model_cfg, linear_factory), train, self.dims, self.device)
        self.model, self.model_parts = self.parallel.module, self.parallel.parts
        # ranks of one tp x pp x cp replica read the same batch
        self.batcher = TokenBatcher(
            data.tokens,
            model_cfg.seq_len,
            train.micro_batch,
            rank=self.dims.dp_rank,
            world_size=self.dims.dp,
            seed=ctx.cfg.seed,
            grad_accum=train.grad_accum,
        )
        self.moe_metrics = None
        if model_cfg.moe is not None:  # first, so every other callback sees the MoE metrics
            self.moe_metrics = MoEMetrics(self.model_parts, self.dims.ep, model_cfg, self.dims.pp)
            self.callbacks.insert(1 if self.requeue else 0, self.moe_metrics)
        self.optimizer = OptimizerParts(
            self.model_parts,
            lr=train.lr,
            betas=(train.beta1, train.beta2),
            weight_decay=train.weight_decay,
            foreach=True,
        )
        self.autocast = autocast or self._default_autocast()
        self.flops_per_token = flops_per_token(model_cfg)
        self.model_params = num_params(model_cfg)
        self.tokens_per_step = self.batcher.global_batch * model_cfg.seq_len
        self.tf32 = train.precision == "fp32" and perf.enable_tf32(
            self.device
        )  # in the summary: matmul_tf32
        self.peak_flops, self.peak_flops_source = peak_flops or agreed_peak_flops(
            self.device, train.precision, self.world_size
        )

    # ------------------------------------------------------------------ set-up helpers

    def _default_autocast(self) -> Callable[[], ContextManager]:
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); without it autocast does for bf16.
        if self.train.precision == "bf16" and not self.parallel.fsdp:
            return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext

    def _call(self, hook: str, *args) -> list:
        return [getattr(cb, hook)(self, *args) for cb in self.callbacks]

    # ------------------------------------------------------------------ schedule

    def scheduled_lr(self, step: int) -> float:
        """LR for (1-based) optimizer step `step`: linear warmup, cosine to min_lr at the last
        step."""
        t = self.train
        if step <= t.warmup_steps:
            return t.lr * step / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))

    # ------------------------------------------------------------------ one step

    def _forward_backward(self, step: int) -> tuple[float, float]:
        """All micro-batches of one step on this rank's parts; the global loss and grad norm."""
        batches = [self.batcher.next() for _ in range(self.train.grad_accum)]
        scale = self.grad_scaler.scale if self.grad_scaler is not None else None
        local = self.parallel.forward_backward(batches, self.autocast, scale)
        self._call("after_backward", step)
        loss = self.parallel.global_loss(local)
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
            self._agree_on_found_inf()
        return loss, self.parallel.clip_grad_norm(self.train.grad_clip)

    def _agree_on_found_inf(self) -> None:
        """With sharded grads each rank only sees its shard's inf/NaN: take the max over ranks so
        every rank skips (or takes) the same step. Uses GradScaler's per-optimizer record."""
        if self.world_size == 1 or not self.parallel.fsdp:
            return
        state = self.grad_scaler._per_optimizer_states[id(self.optimizer)]
        for found in state["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)

    def train_step(self) -> dict:
        """One optimizer step; returns (and records) its metrics."""
        step = self.step + 1
        self._call("on_step_start", step)
        lr = self.scheduled_lr(step) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        watch = Stopwatch(self.device)
        watch.start()
        loss, grad_norm = self._forward_backward(step)
        take = all(
            r is not False for r in self._call("before_optimizer_step", step, loss, grad_norm)
        )
        if take:
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        else:
            self.ctx.writer.event(
                "skipped_step",
                step=step,
                loss=finite_or_none(loss),
                grad_norm=finite_or_none(grad_norm),
            )
        if self.grad_scaler is not None:
            self.grad_scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        step_time = watch.stop()
        self.step = step
        metrics = step_metrics(self, step, loss, grad_norm, lr, step_time, take)
        self._call("on_step_end", step, metrics)
        if not (metrics["warmup_step"] or metrics.get("timing_excluded")):  # e.g. a profiled step
            self.step_times.append(step_time)
        self.ctx.writer.record("step", **metrics)
        self.ctx.writer.scalars("train", step, **{k: metrics.get(k) for k in SCALARS})
        self._recorded = step
        if self._offset_due == step:  # saved from a callback's on_step_end, before this record
            self._note_offset()
        return metrics

    def _note_offset(self) -> None:
        """How far the records go at the checkpoint of this step: a requeued run cuts back to it."""
        requeue.note_offset(self.ctx.run_dir, self.ctx.rank, self.step)
        self._offset_due = None

    def skip_batch(self) -> None:
        """Advance the data position one optimizer step without training on it (step count
        unchanged)."""
        self.batcher.step, self.batcher.micro_step = self.batcher.step + 1, 0

    # ------------------------------------------------------------------ checkpoints

    def _trainer_state(self) -> dict:
        return {"step": self.step, "lr_scale": self.lr_scale, "data": self.batcher.state_dict()}

    def save_checkpoint(self) -> str:
        root = self.train.checkpoint_dir or str(self.ctx.run_dir / "checkpoints")
        if (
            self.requeue
        ):  # a resume from here keeps the records up to this step's (see _note_offset)
            self._offset_due = self.step
            if self._recorded == self.step:
                self._note_offset()
        path = checkpoint.save(
            checkpoint_folders.step_dir(root, self.step),
            self.model_parts,
            self.optimizer,
            self._trainer_state(),
        )
        self.last_checkpoint = str(path)
        self.ctx.writer.event("checkpoint_saved", step=self.step, path=str(path))
        if self.ctx.is_main:  # every rank has finished its shards when dcp.save returns
            checkpoint_folders.prune(
                root, self.train.keep_checkpoints, {*self.pinned, self.last_checkpoint}
            )
        return self.last_checkpoint

    def load_checkpoint(self, path) -> None:
        path = checkpoint_folders.resolve(path)
        checkpoint.check_compatible(path, self.model_parts, self.train.steps)
        state = checkpoint.load(path, self.model_parts, self.optimizer, self._trainer_state())
        try:
            self.batcher.load_state_dict(state["data"])
        except ValueError as e:
            raise UserError(f"cannot resume from {path}: {e}") from None
        self.step, self.lr_scale = int(state["step"]), float(state["lr_scale"])
        self.last_checkpoint = str(path)
        self.ctx.writer.event("checkpoint_loaded", step=self.step, path=str(path))

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        requeued_from = (
            preemption.resume(self) if self.requeue else None
        )  # a requeued job continues its own
        if requeued_from or self.train.resume_from:
            self.load_checkpoint(requeued_from or self.train.resume_from)
        self._recorded = self.step
        self._call("on_train_start")
        last: dict = {}
        if (
            self.requeue and requeue.restart_count()
        ):  # drop what this attempt repeated and the last one wrote after
            requeue.rewind_records(self.ctx.run_dir, self.ctx.rank, self.step)
            self.ctx.writer.event("resumed", step=self.step, checkpoint=requeued_from)
            last = (
                preemption.last_step_record(self.ctx.run_dir, self.step) if self.ctx.is_main else {}
            )
        if self.requeue:
            self._note_offset()
        progress = self._progress()
        while self.step < self.train.steps:
            last = self.train_step()
            progress.update(1)
            if self.train.log_every and self.ctx.is_main and self.step % self.train.log_every == 0:
                loss = "nan" if last["loss"] is None else f"{last['loss']:.4f}"
                progress.write(
                    f"step {self.step:5d}  loss {loss}  {last['tokens_per_s']:.0f} tok/s  "
                    f"mfu {last['mfu']:.3f}"
                )
            if self.train.checkpoint_every and self.step % self.train.checkpoint_every == 0:
                self.save_checkpoint()
        progress.close()
        self._call("on_train_end")
        require_finite_end(last)
        return final_metrics(self, last)

    def _progress(self):
        from dtrain.core.terminal import bar

        # on a terminal only (rank 0); in a pipe the periodic step lines show progress
        return bar(
            total=self.train.steps,
            initial=self.step,
            desc=f"train {self.train.strategy}",
            show=self.ctx.is_main,
            leave=True,
        )
