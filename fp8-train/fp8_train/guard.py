"""NaN/Inf guard and recovery ladder, as a training-loop Callback.

Every step the Trainer all-reduces loss and grad norm, so a NaN or Inf on any rank makes both
non-finite on every rank and all ranks climb the same rung at the same step:

    1. skip the update                                   (each bad step; event `nonfinite`)
    2. after `lr_cut_after` bad steps in a row: LR x `lr_cut_factor`         (event `lr_cut`);
       undone one notch per `lr_restore_after` clean steps in a row          (event `lr_restore`)
    3. after `rollback_after` in a row: reload the last good checkpoint, and skip the batches
       that went bad when the replay reaches them                           (event `rollback`)
    4. optionally switch the first offending layer to high precision (event
    `layer_to_high_precision`)

The `nonfinite` event (written by every rank, for its own view) names the first layer whose
output went non-finite in forward, the first whose output gradient did in backward, the
parameters with non-finite gradients, and the current FP8 / loss scales. With fp16 a non-finite
gradient under a finite loss is GradScaler's business (it skips and halves the scale): that is
logged as `fp16_overflow`, not treated as a NaN.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dtrain.train import Callback
from dtrain.train.parallelize import unwrap
from fp8_train.backends import to_high_precision
from fp8_train.emulated import fp8_layers


def _is_linear(module) -> bool:
    return hasattr(module, "in_features") and isinstance(
        getattr(module, "weight", None), torch.Tensor
    )


class NanGuard(Callback):
    def __init__(self, cfg):
        self.cfg = cfg
        self.bad_in_a_row = 0
        self.good_in_a_row = 0
        self.nan_events = 0
        self.rollbacks = 0
        self.skip_positions: set[int] = set()
        self.streak_positions: list[int] = []
        self.last_good: str | None = None
        self.switched: list[str] = []
        self._flags: list[tuple[str, str, torch.Tensor]] = []
        self._rollback_pending = False
        self._offender: str | None = None
        self._position = 0
        self._scale = None

    # ---------------------------------------------------------------- where it went bad

    def on_train_start(self, trainer) -> None:
        for name, module in unwrap(trainer.model).named_modules():
            if _is_linear(module):
                module.register_forward_hook(self._watch(name))
        if self.cfg.rollback_after and trainer.last_checkpoint is None:
            self.last_good = trainer.save_checkpoint()  # something to roll back to
        self.last_good = self.last_good or trainer.last_checkpoint
        trainer.pinned = {self.last_good}  # checkpoint pruning keeps the rollback target

    def _watch(self, name: str):
        def hook(module, inputs, output):
            if not torch.is_grad_enabled():
                return
            self._flags.append(("activation", name, torch.isfinite(output).all()))  # no sync yet
            if output.requires_grad:
                output.register_hook(
                    lambda g: self._flags.append(("gradient", name, torch.isfinite(g).all()))
                )

        return hook

    def _first_bad(self, tensor: str) -> str | None:
        return next((n for t, n, ok in self._flags if t == tensor and not bool(ok)), None)

    def _bad_params(self, trainer) -> list[str]:
        names = []
        for name, p in unwrap(trainer.model).named_parameters():
            g = p.grad
            if g is not None:
                g = g.to_local() if hasattr(g, "to_local") else g
                if not bool(torch.isfinite(g).all()):
                    names.append(name)
        return names[: int(self.cfg.report_params)]

    @staticmethod
    def scales(trainer) -> dict:
        out = {name: layer.scales() for name, layer in fp8_layers(unwrap(trainer.model)).items()}
        if trainer.grad_scaler is not None:
            out["loss_scale"] = float(trainer.grad_scaler.get_scale())
        return out

    # ---------------------------------------------------------------- the ladder

    def on_step_start(self, trainer, step: int) -> None:
        while trainer.batcher.step in self.skip_positions:
            trainer.ctx.writer.event("skip_batch", step=step, data_position=trainer.batcher.step)
            self.skip_positions.discard(trainer.batcher.step)
            trainer.skip_batch()
        self._position = trainer.batcher.step
        self._flags.clear()
        if trainer.grad_scaler is not None:
            self._scale = float(trainer.grad_scaler.get_scale())

    def before_optimizer_step(self, trainer, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.bad_in_a_row, self.streak_positions, self._offender = 0, [], None
            self.good_in_a_row += 1
            restore = int(self.cfg.lr_restore_after)
            if restore and trainer.lr_scale < 1.0 and self.good_in_a_row % restore == 0:
                trainer.lr_scale = min(1.0, trainer.lr_scale / float(self.cfg.lr_cut_factor))
                trainer.ctx.writer.event(
                    "recovery", step=step, action="lr_restore", lr_scale=trainer.lr_scale
                )
            return True
        self.good_in_a_row = 0
        w = trainer.ctx.writer
        if trainer.grad_scaler is not None and math.isfinite(loss):
            w.event("fp16_overflow", step=step, loss_scale=float(trainer.grad_scaler.get_scale()))
            return True  # GradScaler skips this update and lowers the scale
        self.nan_events += 1
        self.bad_in_a_row += 1
        self.streak_positions.append(self._position)
        self._offender = (
            self._first_bad("activation") or self._first_bad("gradient") or self._offender
        )
        w.event(
            "nonfinite",
            step=step,
            loss=str(loss),
            grad_norm=str(grad_norm),
            first_nonfinite_activation=self._first_bad("activation"),
            first_nonfinite_gradient=self._first_bad("gradient"),
            nonfinite_grad_params=self._bad_params(trainer),
            scales=self.scales(trainer),
            bad_in_a_row=self.bad_in_a_row,
        )
        w.event("recovery", step=step, action="skip_step")
        if self.cfg.lr_cut_after and self.bad_in_a_row == self.cfg.lr_cut_after:
            trainer.lr_scale *= float(self.cfg.lr_cut_factor)
            w.event("recovery", step=step, action="lr_cut", lr_scale=trainer.lr_scale)
        if self.cfg.rollback_after and self.bad_in_a_row >= self.cfg.rollback_after:
            self._rollback_pending = True  # after the Trainer has closed this step
        return False

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if trainer.grad_scaler is not None and self._scale is not None:
            new = float(trainer.grad_scaler.get_scale())
            if new != self._scale:
                trainer.ctx.writer.event("loss_scale_change", step=step, old=self._scale, new=new)
        metrics["nan_events"] = self.nan_events
        if self._rollback_pending:
            self._rollback(trainer, step)
        elif (
            self.cfg.checkpoint_every
            and step % self.cfg.checkpoint_every == 0
            and self.bad_in_a_row == 0
        ):
            self.last_good = trainer.save_checkpoint()
            trainer.pinned = {self.last_good}

    def _rollback(self, trainer, step: int) -> None:
        self._rollback_pending = False
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise RuntimeError(
                f"NaN guard: still non-finite after {self.rollbacks} rollbacks (step {step}); "
                "see events.jsonl `nonfinite` for the layers involved"
            )
        self.rollbacks += 1
        lr_scale = trainer.lr_scale  # a cut stays cut across the rollback
        trainer.load_checkpoint(self.last_good)
        trainer.lr_scale = lr_scale
        self.skip_positions.update(self.streak_positions)
        trainer.ctx.writer.event(
            "recovery",
            step=step,
            action="rollback",
            to_step=trainer.step,
            checkpoint=self.last_good,
            skip_data_positions=sorted(self.streak_positions),
        )
        self.bad_in_a_row, self.streak_positions = 0, []
        if self.cfg.to_high_precision:
            self._switch_offender(trainer, step)

    def _switch_offender(self, trainer, step: int) -> None:
        names = [self._offender]
        if (
            dist.is_initialized() and trainer.world_size > 1
        ):  # the rank that saw it tells the others
            names = [None] * trainer.world_size
            dist.all_gather_object(names, self._offender)
        name = next((n for n in names if n), None)
        if name is None:
            return
        module = unwrap(trainer.model).get_submodule(name)
        switched = to_high_precision(module)
        if switched:
            self.switched.append(name)
        trainer.ctx.writer.event(
            "recovery", step=step, action="layer_to_high_precision", layer=name, switched=switched
        )
