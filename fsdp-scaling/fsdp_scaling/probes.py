"""Callbacks that measure a training run: state bytes per rank, and a profiled window of steps."""

from __future__ import annotations

import threading
from pathlib import Path

from dtrain.train import Callback
from fsdp_scaling import memory, overlap


class StateBytes(Callback):
    """Gradients are measured just before the first optimizer step (they exist only then);
    parameters and optimizer state at the end of training."""

    def __init__(self):
        self.measured: dict[str, int] = {}

    def before_optimizer_step(self, trainer, step, loss, grad_norm):
        if "grads" not in self.measured:
            self.measured["grads"] = memory.measure_grads(trainer.model)
        return True

    def on_train_end(self, trainer):
        self.measured["params"] = memory.measure_params(trainer.model)
        self.measured["optimizer"] = memory.measure_optimizer(trainer.optimizer)


class ProfileWindow(Callback):
    """torch.profiler over `steps` consecutive steps starting at `first`, on every rank (so the
    ranks stay symmetric); rank 0 exports its Chrome trace and reduces it to overlap numbers.
    Profiled steps are kept out of the run's step-time statistics."""

    def __init__(self, first: int, steps: int, out_dir: Path):
        self.first, self.last, self.steps = first, first + steps - 1, steps
        self.out_dir = Path(out_dir)
        self.result: dict | None = None
        self.breakdown: dict | None = (
            None  # overlap.step_breakdown: compute / TP / PP / DP time per step
        )
        self.trace_path: Path | None = None
        self._prof = None

    def on_step_start(self, trainer, step):
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if trainer.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._tid = threading.get_native_id()
            self._prof = profile(activities=activities)
            self._prof.__enter__()

    def on_step_end(self, trainer, step, metrics):
        if self._prof is None or not self.first <= step <= self.last:
            return
        metrics["timing_excluded"] = True
        if step < self.last:
            return
        self._prof.__exit__(None, None, None)
        if trainer.ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.trace_path = self.out_dir / "trace.rank0.json.gz"
            self._prof.export_chrome_trace(str(self.trace_path))
            trace = overlap.read_trace(self.trace_path)
            self.result = overlap.overlap_stats(
                overlap.intervals_from_trace(trace, self._tid), steps=self.steps
            )
            trainer.ctx.writer.record(
                "overlap", steps=self.steps, first_step=self.first, **self.result
            )
            self.breakdown = overlap.step_breakdown(trace, self._tid, steps=self.steps)
            trainer.ctx.writer.record(
                "step_breakdown", steps=self.steps, first_step=self.first, **self.breakdown
            )
        self._prof = None
