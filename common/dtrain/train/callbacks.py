"""Hooks into the training loop; every method is an optional no-op.

    on_train_start(trainer)                      after set-up (and resume), before step 1
    on_step_start(trainer, step)                 step = the 1-based step about to run
    after_backward(trainer, step)                grads ready (scaled if a grad_scaler is used),
                                                 before clipping
    before_optimizer_step(trainer, step, loss, grad_norm) -> bool   False = skip the update
    on_step_end(trainer, step, metrics)          metrics is mutable; what is added gets recorded
                                                 (metrics["timing_excluded"] = True keeps the step
                                                 out of the run's step-time statistics, e.g. a
                                                 profiled step)
    on_train_end(trainer)

loss and grad_norm are the same on every rank, so a callback deciding from them decides the same
everywhere (it must: a skipped update on one rank only would desynchronise the replicas).
"""

from __future__ import annotations


class Callback:
    def on_train_start(self, trainer) -> None:
        pass

    def on_step_start(self, trainer, step: int) -> None:
        pass

    def after_backward(self, trainer, step: int) -> None:
        pass

    def before_optimizer_step(self, trainer, step: int, loss: float, grad_norm: float) -> bool:
        return True

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        pass

    def on_train_end(self, trainer) -> None:
        pass
