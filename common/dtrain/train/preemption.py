"""The trainer's half of preemption and requeue (see dtrain/run/requeue.py for the whole story).

`StopOnSignal` is a callback the Trainer adds inside a Slurm job: USR2/TERM set a flag; at each
step boundary the ranks agree on it (one all-reduce of one number), save a DCP checkpoint of the
completed steps, write `preempted`, and leave: on USR2, rank 0 hands over to submitit's handler
(checkpoint(), time-out count, `scontrol requeue`); on TERM Slurm is already ending or requeueing
the job. `resume(trainer)` is the other side: the latest complete checkpoint of this run when
the job was requeued.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.core.errors import UserError
from dtrain.results.loader import read_jsonl
from dtrain.run import requeue
from dtrain.train import checkpoint_folders, checkpoint_integrity
from dtrain.train.callbacks import Callback

NONE, TERM, PREEMPT = 0, 1, 2  # agreed as a max over ranks: USR2 (requeue ourselves) wins over TERM


class StopOnSignal(Callback):
    def __init__(self) -> None:
        self.caught = NONE
        self.previous: dict[int, object] = {}
        self.signals = {requeue.preempt_signal(): PREEMPT, signal.SIGTERM: TERM}

    def _catch(self, signum, frame) -> None:
        self.caught = max(self.caught, self.signals.get(signum, TERM))

    def on_train_start(self, trainer) -> None:
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._catch)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def on_train_end(self, trainer) -> None:
        self.restore()

    def _agreed(self, trainer) -> int:
        if trainer.world_size == 1 or not dist.is_initialized():
            return self.caught
        flag = torch.tensor([float(self.caught)], device=trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def on_step_start(self, trainer, step: int) -> None:
        agreed = self._agreed(trainer)
        if agreed != NONE:
            self.stop(trainer, agreed)

    def stop(self, trainer, agreed: int) -> None:
        submitit_handler = self.previous.get(requeue.preempt_signal())
        self.restore()
        saved = trainer.last_checkpoint
        if trainer.step > 0 and not (
            saved and Path(saved).name == checkpoint_folders.step_dir("", trainer.step).name
        ):
            saved = trainer.save_checkpoint()
        reason = "terminated"  # TERM: a requeue, a preemption or a cancel, decided by Slurm
        if agreed == PREEMPT:
            timed_out = getattr(getattr(submitit_handler, "__self__", None), "has_timed_out", None)
            reason = "time_limit" if timed_out and timed_out() else "preempted"
        trainer.ctx.writer.event(
            "preempted",
            step=trainer.step,
            reason=reason,
            checkpoint=saved,
            signal="USR2" if agreed == PREEMPT else "TERM",
        )
        trainer.ctx.writer.close()  # flush before leaving
        if trainer.world_size > 1:
            dist.barrier()
        if agreed == PREEMPT and callable(submitit_handler):
            # rank 0: pickles checkpoint(), `scontrol requeue`, exits; other ranks: returns at once.
            # Raises UncompletedJobError when the time-outs are used up (the job then fails).
            submitit_handler(requeue.preempt_signal(), None)
        raise SystemExit(
            0
        )  # not an Exception: Hydra and submitit let it through, no result is written


def resume(trainer) -> str | None:
    """The checkpoint a requeued attempt continues from: the latest complete and undamaged one of
    this run (a damaged newer one is passed over with a warning and a `checkpoint_damaged` event;
    when every one is damaged, the damage line). None when there is none yet: it starts again."""
    if requeue.restart_count() == 0:
        return None
    root = Path(trainer.train.checkpoint_dir or trainer.ctx.run_dir / "checkpoints")
    if not root.is_dir():
        return None
    path, skipped = _agreed(trainer, lambda: checkpoint_integrity.latest_intact(root))
    for bad, problem in skipped if trainer.ctx.is_main else ():
        trainer.ctx.writer.event(
            "checkpoint_damaged",
            path=str(bad),
            problem=problem,
            resumed_from=str(path) if path else None,
        )
        print(
            f"warning: checkpoint {bad} is damaged ({problem}): resuming from {path}",
            file=sys.stderr,
            flush=True,
        )
    if path is None and skipped:
        bad, problem = skipped[0]
        raise UserError(
            f"checkpoint {bad} is damaged ({problem}) and no earlier checkpoint of "
            f"this run is intact: remove the damaged ones from {root} to start again"
        )
    return str(path) if path else None


def _agreed(trainer, decide):
    """Rank 0's `decide()` on every rank: it alone reads the checkpoints through (checksums)."""
    if trainer.world_size > 1 and dist.is_initialized():
        box = [decide() if trainer.ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=trainer.device)
        return box[0]
    return decide()


def last_step_record(run_dir: Path, step: int) -> dict:
    """The kept `step` record of `step` (a resumed run that had already finished every step)."""
    f = requeue.records_file(run_dir, 0)
    rows = (
        [r for r in read_jsonl(f) if r.get("kind") == "step" and r.get("step") == step]
        if f.exists()
        else []
    )
    return rows[-1] if rows else {}
