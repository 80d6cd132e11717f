"""Training-health series and alerts, as a Callback (rank 0 records; every rank computes, since
norms over FSDP2-sharded parameters need a collective).

Series added to each `step` record every `every` steps:
    param_norm      ||theta||
    update_ratio    ||theta_after - theta_before|| / ||theta_before||   (healthy around 1e-3)
    grad_snr        ||m_hat||^2 / sum(v_hat - m_hat^2) from AdamW's moments: how much of the
                    gradient is signal that persists across steps vs noise
    fp8_scale_min   smallest FP8 scale over the emulated layers (per-layer values: `fp8_scales`
                    records)
plus what the Trainer already records (loss, grad_norm, tokens/s, memory, fp16 loss scale).

Alerts (events of kind `alert`, and a console line on rank 0):
    grad_norm_spike   z-score of grad norm against the previous `window` steps > spike_z
    loss_plateau      loss improved < plateau_rel over `window` steps while grad norm did not fall
    scale_drop        a layer's FP8 scale fell by > scale_jump x in one sample: amax jumped
                      (overflow, NaN ahead)
    scale_rise        it rose by > scale_jump x: amax collapsed (underflow ahead)
TensorBoard event files go to <run_dir>/tensorboard when `tensorboard: true`.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from dtrain.train import Callback
from dtrain.train.parallelize import unwrap
from fp8_train.emulated import fp8_layers


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sum_squares(trainer, tensors) -> float:
    """Global sum of squares; all-reduced when parameters are sharded (same call on every rank)."""
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for t in tensors:
        total += _local(t).detach().double().pow(2).sum()
    if trainer.train.sharded and trainer.world_size > 1:
        dist.all_reduce(total)
    return float(total)


class HealthMonitor(Callback):
    def __init__(self, cfg, rank: int, run_dir):
        self.cfg, self.rank = cfg, rank
        self.every = max(1, int(cfg.every))
        self.grad_norms: list[float] = []
        self.losses: list[float] = []
        self.scales: dict[str, float] = {}
        self.scales_step = 0  # step of the last scale sample
        self.before: list[torch.Tensor] | None = None
        self.last_plateau_alert = -(10**9)
        self.tb = None
        if cfg.tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def sampled(self, step: int) -> bool:
        return step % self.every == 0 or step == 1

    def before_optimizer_step(self, trainer, step, loss, grad_norm) -> bool:
        if self.sampled(step):
            self.before = [_local(p).detach().clone() for p in trainer.model.parameters()]
        return True

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if self.sampled(step):
            params = list(trainer.model.parameters())
            norm_sq = sum_squares(trainer, params)
            metrics["param_norm"] = math.sqrt(norm_sq)
            if self.before is not None:
                delta = sum_squares(trainer, [_local(p) - b for p, b in zip(params, self.before)])
                metrics["update_ratio"] = math.sqrt(delta / norm_sq) if norm_sq > 0 else None
                self.before = None
            metrics["grad_snr"] = self.grad_snr(trainer)
            self.check_scales(trainer, step, metrics)
        self.check_trends(trainer, step, metrics)
        if self.tb is not None:
            for key, value in metrics.items():
                if (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and value is not None
                ):
                    self.tb.add_scalar(f"train/{key}", value, step)

    def grad_snr(self, trainer) -> float | None:
        beta1, beta2 = trainer.train.beta1, trainer.train.beta2
        moments = []
        for p in trainer.model.parameters():
            state = trainer.optimizer.state.get(p, {})
            if "exp_avg" in state:
                t = float(state["step"])
                m = _local(state["exp_avg"]).double() / (1 - beta1**t)
                v = _local(state["exp_avg_sq"]).double() / (1 - beta2**t)
                moments.append((m, v))
        if not moments:
            return None
        signal = sum_squares(trainer, [m for m, _ in moments])
        noise = sum(float((v - m * m).clamp(min=0).sum()) for m, v in moments)
        if trainer.train.sharded and trainer.world_size > 1:
            t = torch.tensor(noise, dtype=torch.float64, device=trainer.device)
            dist.all_reduce(t)
            noise = float(t)
        return signal / noise if noise > 0 else None

    # ---------------------------------------------------------------- alerts

    def alert(self, trainer, step: int, kind: str, message: str, **values) -> None:
        trainer.ctx.writer.event("alert", step=step, alert=kind, message=message, **values)
        if self.rank == 0:
            print(f"[health] step {step}: {kind}: {message}", flush=True)

    def check_scales(self, trainer, step: int, metrics: dict) -> None:
        # A layer switched to high precision has no live scale (no false "scale dropped" after the
        # switch); after a rollback the scales are the checkpoint's, so the comparison restarts.
        layers = {n: m for n, m in fp8_layers(unwrap(trainer.model)).items() if m.fp8_enabled}
        if step <= self.scales_step:
            self.scales = {}
        self.scales_step = step
        jump = float(self.cfg.scale_jump)
        current = {}
        for name, layer in layers.items():
            for role, scale in layer.scales().items():
                current[f"{name}.{role}"] = scale
            if layer.scales():
                trainer.ctx.writer.record("fp8_scales", step=step, layer=name, **layer.scales())
        for key, scale in current.items():
            old = self.scales.get(key)
            if old and scale < old / jump:
                self.alert(
                    trainer,
                    step,
                    "scale_drop",
                    f"{key} scale {old:.3g} -> {scale:.3g}: amax jumped, overflow/NaN ahead",
                    key=key,
                    old=old,
                    new=scale,
                )
            elif old and scale > old * jump:
                self.alert(
                    trainer,
                    step,
                    "scale_rise",
                    f"{key} scale {old:.3g} -> {scale:.3g}: amax collapsed, underflow ahead",
                    key=key,
                    old=old,
                    new=scale,
                )
        self.scales = current
        if current:
            metrics["fp8_scale_min"] = min(current.values())

    def check_trends(self, trainer, step: int, metrics: dict) -> None:
        window = int(self.cfg.window)
        g, loss = metrics.get("grad_norm"), metrics.get("loss")
        if g is None or loss is None:
            return  # non-finite: the NaN guard's business
        past = self.grad_norms[-window:]
        if len(past) >= max(5, window // 2):
            std = statistics.pstdev(past)
            z = (g - statistics.fmean(past)) / std if std > 0 else 0.0
            if z > float(self.cfg.spike_z):
                self.alert(
                    trainer,
                    step,
                    "grad_norm_spike",
                    f"grad norm {g:.3g} is {z:.1f} sigma above the last {len(past)} steps",
                    z=z,
                    grad_norm=g,
                )
        self.grad_norms.append(g)
        self.losses.append(loss)
        if len(self.losses) >= 2 * window and step - self.last_plateau_alert >= window:
            old_loss, new_loss = (
                statistics.fmean(self.losses[-2 * window : -window]),
                statistics.fmean(self.losses[-window:]),
            )
            old_g, new_g = (
                statistics.fmean(self.grad_norms[-2 * window : -window]),
                statistics.fmean(self.grad_norms[-window:]),
            )
            if (old_loss - new_loss) < float(self.cfg.plateau_rel) * abs(
                old_loss
            ) and new_g >= old_g:
                self.last_plateau_alert = step
                self.alert(
                    trainer,
                    step,
                    "loss_plateau",
                    f"loss {old_loss:.4g} -> {new_loss:.4g} over {window} "
                    f"steps while grad norm {old_g:.3g} -> {new_g:.3g} did not fall",
                    old_loss=old_loss,
                    new_loss=new_loss,
                )

    def on_train_end(self, trainer) -> None:
        if self.tb is not None:
            self.tb.close()
