"""Per-step MoE metrics of a training run, and the sigmoid router's bias update (DeepSeek-V3's
auxiliary-loss-free balancing), as one trainer callback.

Each step, every MoE layer's counts (dtrain.model.moe: assignments per expert, dropped ones, rows
its rank's experts computed, summed over the micro-batches) are summed over the ranks (a tp = pp =
1 layout: every rank holds every layer and different tokens), and the step record gets

    moe_tokens_per_expert  assignments per expert, summed over the MoE layers
    moe_overload           Megatron's overload factor, the worst layer's: with ep > 1 the busiest
                           rank's rows over the balanced count (routed assignments / ranks), at
                           ep = 1 the busiest expert's assignments over the balanced count
                           (assignments / experts)
    moe_expert_overload    the busiest expert's, at any ep
    moe_dropped            assignments over capacity (0 when dropless), all layers and ranks
    moe_dropped_frac       of all assignments

The run's summary gets their mean / max over the timed steps (`summary`).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from dtrain.model.gpt import moe_layers
from dtrain.train.callbacks import Callback


def overload(busiest: float, balanced: float) -> float:
    """Megatron's overload factor: the busiest expert's (or rank's) load over the balanced one."""
    return busiest / balanced if balanced else math.nan


class MoEMetrics(Callback):
    def __init__(self, parts, ep: int):
        self.layers = [m for part in parts for m in moe_layers(part)]
        self.ep = ep
        self.history: list[dict] = []

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        stats = [m.take_stats() for m in self.layers]
        E = self.layers[0].moe.experts
        # per layer: E counts, dropped, rows computed here (summed), rows (max over ranks)
        summed = torch.tensor(
            [[*s["tokens_per_expert"].tolist(), s["dropped"], s["rank_rows"]] for s in stats],
            dtype=torch.float64,
        )
        busiest = summed[:, -1].clone()
        world = trainer.world_size
        if world > 1 and dist.is_initialized():
            device = trainer.device
            summed, busiest = summed.to(device), busiest.to(device)
            dist.all_reduce(summed)
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            summed, busiest = summed.cpu(), busiest.cpu()
        counts, dropped = summed[:, :E], summed[:, E]
        routed = counts.sum(1)
        expert_over = [overload(float(c.max()), float(r) / E) for c, r in zip(counts, routed)]
        rank_over = [overload(float(b), float(r) / world) for b, r in zip(busiest, routed)]
        m = {
            "moe_tokens_per_expert": [int(v) for v in counts.sum(0).tolist()],
            "moe_overload": max(rank_over if self.ep > 1 else expert_over),
            "moe_expert_overload": max(expert_over),
            "moe_dropped": int(dropped.sum()),
            "moe_dropped_frac": float(dropped.sum() / routed.sum()),
        }
        metrics.update(m)
        self.history.append({**m, "timed": not metrics.get("warmup_step", False)})
        self._update_bias(counts)

    @torch.no_grad()
    def _update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3 §2.1.2: b_i += gamma · sign(mean load - load_i), from the global counts, so
        every rank takes the same step."""
        for moe, c in zip(self.layers, counts):
            rate = moe.moe.bias_update_rate
            if moe.moe.router != "sigmoid" or not rate:
                continue
            step = rate * torch.sign(c.mean() - c)
            moe.router.expert_bias.add_(step.to(moe.router.expert_bias))

    def summary(self) -> dict:
        """The run's MoE figures over its timed steps (all steps when none was timed)."""
        rows = [h for h in self.history if h["timed"]] or self.history
        if not rows:
            return {}
        return {
            "moe_overload_mean": statistics.fmean(h["moe_overload"] for h in rows),
            "moe_overload_max": max(h["moe_overload"] for h in rows),
            "moe_expert_overload_mean": statistics.fmean(h["moe_expert_overload"] for h in rows),
            "moe_dropped_frac_mean": statistics.fmean(h["moe_dropped_frac"] for h in rows),
            "moe_tokens_per_expert": [
                sum(h["moe_tokens_per_expert"][e] for h in rows)
                for e in range(len(rows[0]["moe_tokens_per_expert"]))
            ],
        }
