"""Per-step MoE metrics of a training run, and the sigmoid router's bias update (DeepSeek-V3's
auxiliary-loss-free balancing), as one trainer callback.

Each step, every MoE layer's counts (dtrain.model.moe: assignments per expert, dropped ones, rows
its rank's experts computed, summed over the micro-batches) are summed over the ranks, one row per
global layer index, so a pipeline stage's layers reach every rank (a rank fills only its stages'
rows; tp ranks route disjoint tokens, dtrain.parallel.ep.moe_tp, so their counts add too), and the
step record gets

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

from dtrain.model.moe import MoE
from dtrain.train.callbacks import Callback


def overload(busiest: float, balanced: float) -> float:
    """Megatron's overload factor: the busiest expert's (or rank's) load over the balanced one."""
    return busiest / balanced if balanced else math.nan


def _layer_index(name: str, position: int) -> int:
    """The global block index in an MoE module's name (``blocks.{i}.mlp``, wrappers between);
    its position among the layers for a module outside a GPT's blocks."""
    parts = name.split(".")
    return int(parts[parts.index("blocks") + 1]) if "blocks" in parts[:-1] else position


class MoEMetrics(Callback):
    """`model_cfg` (the GPTConfig): the model's MoE layers, whichever rank holds them; without
    it, the layers in `parts` are all of them."""

    def __init__(self, parts, ep: int, model_cfg=None, pp: int = 1):
        named = [(n, m) for part in parts for n, m in part.named_modules() if isinstance(m, MoE)]
        self.index = [_layer_index(n, j) for j, (n, _) in enumerate(named)]  # global indices
        self.layers = [m for _, m in named]
        if model_cfg is None:
            self.n_layer, self.E = len(self.layers), self.layers[0].moe.experts
            self.moe_rows = list(range(self.n_layer))
        else:
            self.n_layer, self.E = model_cfg.n_layer, model_cfg.moe.experts
            self.moe_rows = [i for i in range(self.n_layer) if model_cfg.moe.is_moe_layer(i)]
        self.ep, self.pp = ep, pp
        self.history: list[dict] = []

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        stats = [m.take_stats() for m in self.layers]
        E = self.E
        # per global layer: E counts, dropped, rows computed here (summed), rows (max over ranks)
        summed = torch.zeros(self.n_layer, E + 2, dtype=torch.float64)
        for i, s in zip(self.index, stats):
            if s["tokens_per_expert"] is not None:
                summed[i] = torch.tensor(
                    [*s["tokens_per_expert"].tolist(), s["dropped"], s["rank_rows"]],
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
        summed, busiest = summed[self.moe_rows], busiest[self.moe_rows]
        counts, dropped = summed[:, :E], summed[:, E]
        routed = counts.sum(1)
        ranks = world // self.pp  # the ranks that hold (and compute) one layer
        expert_over = [overload(float(c.max()), float(r) / E) for c, r in zip(counts, routed)]
        rank_over = [overload(float(b), float(r) / ranks) for b, r in zip(busiest, routed)]
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
        rows = {i: c for i, c in zip(self.moe_rows, counts)}
        for i, moe in zip(self.index, self.layers):
            c = rows[i]
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
