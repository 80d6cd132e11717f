"""The FP8 debug tool: what would FP8 do to this layer's tensors, under each recipe?

For the chosen layers and tensors (activation = the linear's input, weight, gradient = the
output gradient), every `freq` steps and for each recipe it records one `fp8_debug` record:

    cur_amax        max |x|
    scale           the scale the recipe would use (delayed: from the amax history of earlier
                    steps; current: from cur_amax; block recipes: none, per-block)
    underflows_pct  % of the non-zero values that become zero after the round trip
    overflows_pct   % of values with |x * scale| above the format max, counted before the cast
                    (E4M3 saturates them, E5M2 turns them into Inf)
    mse, cos_sim    between x and its round trip, reductions in float64
    (underflow, mse and cosine are estimated on a fixed random subset of `sample_elements`
    elements when a tensor is larger; overflow and amax are always exact; 0 = every element)
    rel_mse         mse / mean(x^2): the same number for a tensor and a rescaled copy of it

The stat names follow nvdlfw-inspect / TE's debug features (underflows%, overflows%, mse,
cur_amax, scale_inv) where they exist; cos_sim is ours. Layers are chosen the way
nvdlfw-inspect does (`layers.layer_name_regex_pattern`). Records are computed on rank 0 only
(its shard of the batch). "delayed" is what TE would do: for our emulated delayed layers it is the
layer's own scale; for any other layer the tool tracks an amax history every step (a cost).

Cost. Steps that are not sampled: nothing for emulated delayed layers, one amax per tensor for
the others. On a sampled step a hook only copies |x| (in blocks, with each block's max) and the
sampled elements; at step end all pending tensors of a format are one batch: scales of every
tensor x recipe at once, overflow counted only in blocks whose max passes the threshold, every
round trip in one (tensors, recipes, elements) pass, two read-backs (`.tolist()`) per format.
Past PENDING_LIMIT held elements a batch runs early, so the copies stay bounded.
"""

from __future__ import annotations

import re
from collections import namedtuple
from pathlib import Path

import torch

from dtrain.train import Callback
from fp8_train import fp4
from fp8_train.emulated import in_recompute
from fp8_train.formats import Format
from fp8_train.quantstats import (
    BLOCK,
    batch_roundtrip,
    block_stats,
    count_above,
    fmt_for,
    overflow_thresholds,
    stats_from_sums,
)
from fp8_train.scaling import amax_of, scale_from_amax

TENSORS = ("activation", "weight", "gradient")
PER_TENSOR = ("delayed", "current")
RECIPES = PER_TENSOR + fp4.BLOCK_RECIPES
F64 = torch.float64
PENDING_LIMIT = 1 << 24  # elements held (|x| + sampled copies) before a batch runs


class AmaxHistory:
    """The history TE's delayed scaling would keep for one tensor (newest last, 0-d tensors)."""

    def __init__(self, length: int):
        self.length, self.values = length, []

    def amax(self, device=None) -> torch.Tensor:
        return torch.stack(self.values).max() if self.values else torch.zeros((), device=device)

    def scale(self, fmt: Format, margin: int) -> float:
        return float(
            scale_from_amax(self.amax(), fmt, margin)
        )  # no history yet: scale 1, as TE starts

    def push(self, amax: torch.Tensor) -> None:
        self.values = (self.values + [amax])[-self.length :]


# A sampled tensor waiting for its batch. ax: |x| (float32 copy, zero-padded (blocks, BLOCK));
# part: the round trip's elements (a copy); own_scale: an emulated delayed layer's scale, else
# history_amax: the tracked history's amax before this step; x: only for block recipes.
Pending = namedtuple(
    "Pending",
    "step layer tensor fmt numel ax block_amax part amax own_scale history_amax sampled x",
)


class DebugTool(Callback):
    def __init__(self, cfg, run_dir: Path, rank: int):
        self.cfg = cfg
        self.freq, self.margin = int(cfg.freq), int(cfg.margin)
        self.e5m2_saturates = cfg.e5m2_overflow == "saturate"
        self.pattern = re.compile(cfg.layers.layer_name_regex_pattern)
        self.tensors = [t for t in cfg.tensors if t in TENSORS]
        self.recipes = [r for r in cfg.recipes if r in RECIPES]
        self.per_tensor = [r for r in self.recipes if r in PER_TENSOR]
        self.formats = {t: fmt_for(t, self.e5m2_saturates) for t in TENSORS}
        self.active = bool(cfg.enabled) and rank == 0
        self.dump_dir = Path(run_dir) / "dumps" if cfg.dump_tensors else None
        self.histories: dict[tuple[str, str], AmaxHistory] = {}
        self.sample_elements = int(cfg.sample_elements)
        self._samples: dict[int, torch.Tensor] = {}
        self.pending: list[Pending] = []
        self._pending_elements = 0
        self.step = 0
        self.layers: list[str] = []
        self.own_scalers: dict[str, object] = {}  # emulated delayed layers: their real scale state
        self._writer = None

    # ---------------------------------------------------------------- hooks

    def on_train_start(self, trainer) -> None:
        if not self.active:
            return
        from dtrain.train.parallelize import unwrap

        self._writer = trainer.ctx.writer
        for name, module in unwrap(trainer.model).named_modules():
            weight = getattr(module, "weight", None)
            if (
                isinstance(weight, torch.Tensor)
                and weight.dim() == 2
                and hasattr(module, "in_features")
                and self.pattern.fullmatch(name)
            ):
                module.register_forward_hook(self._forward_hook(name))
                self.layers.append(name)
                if getattr(module, "scaling", None) == "delayed":
                    self.own_scalers[name] = module
        self._writer.event(
            "debug_layers",
            layers=self.layers,
            freq=self.freq,
            tensors=self.tensors,
            recipes=self.recipes,
        )

    def on_step_start(self, trainer, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        self.flush()  # hooks keep copies, so after the optimizer step is fine

    def sampling(self) -> bool:
        return self.freq > 0 and self.step % self.freq == 0

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not torch.is_grad_enabled() or (name in self.own_scalers and not self.sampling()):
                return  # an emulated delayed layer keeps its own amax history: nothing to track
            if in_recompute():
                return  # activation checkpointing runs this forward again in backward: seen already
            if "activation" in self.tensors:
                self.observe(name, "activation", inputs[0])
            if "weight" in self.tensors:
                self.observe(name, "weight", module.weight)
            if "gradient" in self.tensors and output.requires_grad:
                output.register_hook(lambda g: self.observe(name, "gradient", g))

        return hook

    # ---------------------------------------------------------------- stats

    def observe(self, layer: str, tensor: str, x: torch.Tensor) -> None:
        x = x.detach()
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        own = layer in self.own_scalers
        history = (
            None
            if own
            else self.histories.setdefault(
                (layer, tensor), AmaxHistory(int(self.cfg.amax_history_len))
            )
        )
        if not self.sampling():
            history.push(amax_of(x))  # a tensor: no GPU sync
            return
        xf = x.reshape(-1).float()
        n = xf.numel()
        ax = xf.new_empty(max(1, -(-n // BLOCK)), BLOCK)
        torch.abs(xf, out=ax.view(-1)[:n])
        if n % BLOCK or not n:
            ax.view(-1)[n:].zero_()
        block_amax = ax.amax(1)
        amax = block_amax.amax()  # NaN if any element is NaN, as x.abs().amax()
        sample = self.sample_of(xf)
        part = (
            xf.index_select(0, sample)
            if sample is not None
            else (xf.clone() if x.dtype == torch.float32 else xf)
        )
        self.pending.append(
            Pending(
                self.step,
                layer,
                tensor,
                self.formats[tensor],
                n,
                ax,
                block_amax,
                part,
                amax,
                self.own_scale(layer, tensor) if own else None,
                None if own else history.amax(x.device),
                sample is not None,
                x.clone() if len(self.per_tensor) < len(self.recipes) else None,
            )
        )
        if history is not None:
            history.push(amax)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(exist_ok=True)
            torch.save(x.cpu().clone(), self.dump_dir / f"step{self.step:06d}.{layer}.{tensor}.pt")
        self._pending_elements += ax.numel() + part.numel()
        if self._pending_elements > PENDING_LIMIT:
            self.flush()

    def sample_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """A fixed random subset of flat indices (one per tensor size), or None for all elements."""
        n = x.numel()
        if not self.sample_elements or n <= self.sample_elements:
            return None
        if n not in self._samples:
            gen = torch.Generator().manual_seed(n)
            self._samples[n] = torch.randperm(n, generator=gen)[: self.sample_elements].to(x.device)
        return self._samples[n]

    def own_scale(self, layer: str, tensor: str) -> torch.Tensor:
        """The scale an emulated delayed layer uses for this cast (forward hooks run after the
        cast, the gradient hook before it: its scale buffer changes in place, hence the copy)."""
        module = self.own_scalers[layer]
        if tensor == "gradient":
            return module.grad_output_scaler.scale.detach().clone()
        return (
            module.input_scaler if tensor == "activation" else module.weight_scaler
        ).last_used.detach()

    def flush(self) -> None:
        """Compute and write the records of every pending tensor, one batch per format."""
        pending, self.pending, self._pending_elements = self.pending, [], 0
        groups: dict[Format, list[Pending]] = {}
        for p in pending:
            groups.setdefault(p.fmt, []).append(p)
        stats = {id(p): s for fmt, ps in groups.items() for p, s in zip(ps, self._batch(fmt, ps))}
        for p in pending:
            amax, per_recipe = stats[id(p)]
            for recipe in self.recipes:
                s = per_recipe[recipe] if recipe in PER_TENSOR else block_stats(p.x, recipe)
                self._writer.record(
                    "fp8_debug",
                    step=p.step,
                    layer=p.layer,
                    tensor=p.tensor,
                    recipe=recipe,
                    format=p.fmt.name if recipe in PER_TENSOR else fp4.ELEMENT_FORMAT[recipe].name,
                    cur_amax=amax,
                    numel=p.numel,
                    sampled=p.sampled,
                    **s,
                )

    def _batch(self, fmt: Format, ps: list[Pending]) -> list[tuple[float, dict]]:
        """(cur_amax, {recipe: stats}) for each of ps, all tensors and per-tensor recipes at
        once."""
        amax = torch.stack([p.amax for p in ps]).float()
        if not self.per_tensor:
            return [(a, {}) for a in amax.tolist()]
        columns = {}
        if "current" in self.per_tensor:
            columns["current"] = scale_from_amax(amax, fmt, self.margin)
        if "delayed" in self.per_tensor:
            from_history = torch.tensor([p.own_scale is None for p in ps], device=amax.device)
            history_amax = torch.stack(
                [p.amax if p.history_amax is None else p.history_amax for p in ps]
            ).float()
            own = torch.stack([p.amax if p.own_scale is None else p.own_scale for p in ps]).float()
            columns["delayed"] = torch.where(
                from_history, scale_from_amax(history_amax, fmt, self.margin), own
            )
        R, T = len(self.per_tensor), len(ps)
        scales = torch.stack([columns[r] for r in self.per_tensor], 1)  # (T, R)
        thresholds = overflow_thresholds(scales, fmt)
        head = torch.cat([amax[:, None], scales, thresholds], 1).tolist()  # sync 1 of 2
        # overflow counts, exact over the whole tensor; 0 without counting where amax <= threshold
        count_at = [
            (i, r) for i, row in enumerate(head) for r in range(R) if not row[0] <= row[1 + R + r]
        ]
        counts = [count_above(ps[i].ax, ps[i].block_amax, thresholds[i, r]) for i, r in count_at]
        by_length: dict[int, list[int]] = {}  # round trips: one batch per part length
        for i, p in enumerate(ps):
            by_length.setdefault(p.part.numel(), []).append(i)
        order = [i for rows in by_length.values() for i in rows]
        sums = [
            batch_roundtrip(
                torch.stack([ps[i].part for i in rows]),
                scales[torch.tensor(rows, device=scales.device)],
                fmt,
            )
            for rows in by_length.values()
        ]
        flat = torch.cat(
            [s.reshape(-1) for s in sums]
            + [torch.stack(counts).to(F64) if counts else scales.new_zeros(0, dtype=F64)]
        )
        flat = flat.tolist()  # sync 2 of 2
        K = 2 + 3 * R
        table = {i: flat[j * K : (j + 1) * K] for j, i in enumerate(order)}
        overflow = {(i, r): flat[T * K + j] for j, (i, r) in enumerate(count_at)}
        out = []
        for i, p in enumerate(ps):
            n_nonzero, power, *rest = table[i]
            out.append(
                (
                    head[i][0],
                    {
                        r: {
                            "scale": head[i][1 + k],
                            **stats_from_sums(
                                rest[k],
                                n_nonzero,
                                overflow.get((i, k), 0.0),
                                rest[R + k],
                                power,
                                rest[2 * R + k],
                                p.part.numel(),
                                p.numel,
                            ),
                        }
                        for k, r in enumerate(self.per_tensor)
                    },
                )
            )
        return out
