"""The FP8 debug tool: what would FP8 do to this layer's tensors, under each recipe?

For the chosen layers and tensors (activation = the linear's input, weight, gradient = the
output gradient), every `freq` steps and for each recipe it records one `fp8_debug` record:

    cur_amax        max |x|
    scale           the scale the recipe would use (delayed: from the amax history of earlier
                    steps; current: from cur_amax; block recipes: none, per-block)
    underflows_pct  % of the non-zero values that become zero after the round trip
    overflows_pct   % of values with |x * scale| above the format max, counted before the cast
                    (E4M3 saturates them, E5M2 turns them into Inf)
    mse, cos_sim    between x and its round trip, computed in float64
    rel_mse         mse / mean(x^2): the same number for a tensor and a rescaled copy of it

The stat names follow nvdlfw-inspect / TE's debug features (underflows%, overflows%, mse,
cur_amax, scale_inv) where they exist; cos_sim is ours. Layers are chosen the way
nvdlfw-inspect does (`layers.layer_name_regex_pattern`). Records are computed on rank 0 only
(its shard of the batch); amaxes are tracked every step so "delayed" means what TE would do.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from dtrain.train import Callback
from fp8_train import fp4
from fp8_train.formats import E4M3, E5M2, Format, quantize
from fp8_train.scaling import scale_from_amax

TENSORS = ("activation", "weight", "gradient")
PER_TENSOR = ("delayed", "current")
RECIPES = PER_TENSOR + fp4.BLOCK_RECIPES


def fmt_for(tensor: str, e5m2_saturates: bool = True) -> Format:
    if tensor == "gradient":
        return replace(E5M2, saturate=True) if e5m2_saturates else E5M2
    return E4M3


def roundtrip_stats(x: torch.Tensor, deq: torch.Tensor, scaled: torch.Tensor, fmt: Format) -> dict:
    """Quantization error of one round trip; float64 so tiny errors are not lost. All sums are
    stacked into one tensor and read back at once (one device sync per call)."""
    x64, d64 = x.detach().double().reshape(-1), deq.detach().double().reshape(-1)
    nonzero = x64 != 0
    sums = torch.stack([(nonzero & (d64 == 0)).sum().double(), nonzero.sum().double(),
                        (scaled.detach().abs() > fmt.max).sum().double(), (x64 - d64).pow(2).sum(),
                        x64.pow(2).sum(), d64.pow(2).sum(), x64 @ d64])
    underflow, n_nonzero, overflow, err, power, dpower, dot = sums.tolist()
    n = max(1, x64.numel())
    denom = math.sqrt(power * dpower)
    cos = dot / denom if denom > 0 else (1.0 if err == 0 else 0.0)
    return {"underflows_pct": 100.0 * underflow / max(1.0, n_nonzero), "overflows_pct": 100.0 * overflow / n,
            "mse": err / n, "rel_mse": err / power if power > 0 else 0.0, "cos_sim": cos}


def per_tensor_stats(x: torch.Tensor, scale: float, fmt: Format) -> dict:
    xf = x.detach().float()
    return {"scale": float(scale), **roundtrip_stats(xf, quantize(xf, scale, fmt), xf * scale, fmt)}


def block_stats(x: torch.Tensor, recipe: str) -> dict:
    q = fp4.block_quantize(x.detach().float(), recipe)
    return {"scale": None, **roundtrip_stats(x, q.dequantized, q.scaled, q.fmt)}


class AmaxHistory:
    """The history TE's delayed scaling would keep for one tensor (newest last, 0-d tensors)."""

    def __init__(self, length: int):
        self.length, self.values = length, []

    def scale(self, fmt: Format, margin: int) -> float:
        amax = torch.stack(self.values).max() if self.values else 0.0
        return float(scale_from_amax(amax, fmt, margin))  # no history yet: scale 1, as TE starts

    def push(self, amax: torch.Tensor) -> None:
        self.values = (self.values + [amax])[-self.length:]


class DebugTool(Callback):
    def __init__(self, cfg, run_dir: Path, rank: int):
        self.cfg = cfg
        self.freq, self.margin = int(cfg.freq), int(cfg.margin)
        self.e5m2_saturates = cfg.get("e5m2_overflow", "saturate") == "saturate"
        self.pattern = re.compile(cfg.layers.layer_name_regex_pattern)
        self.tensors = [t for t in cfg.tensors if t in TENSORS]
        self.recipes = [r for r in cfg.recipes if r in RECIPES]
        self.active = bool(cfg.enabled) and rank == 0
        self.dump_dir = Path(run_dir) / "dumps" if cfg.dump_tensors else None
        self.histories: dict[tuple[str, str], AmaxHistory] = {}
        self.step = 0
        self.layers: list[str] = []
        self._writer = None

    # ---------------------------------------------------------------- hooks

    def on_train_start(self, trainer) -> None:
        if not self.active:
            return
        from dtrain.train.parallelize import unwrap

        self._writer = trainer.ctx.writer
        for name, module in unwrap(trainer.model).named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and hasattr(module, "in_features") \
                    and self.pattern.fullmatch(name):
                module.register_forward_hook(self._forward_hook(name))
                self.layers.append(name)
        self._writer.event("debug_layers", layers=self.layers, freq=self.freq, tensors=self.tensors,
                           recipes=self.recipes)

    def on_step_start(self, trainer, step: int) -> None:
        self.step = step

    def sampling(self) -> bool:
        return self.freq > 0 and self.step % self.freq == 0

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not torch.is_grad_enabled():
                return
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
        history = self.histories.setdefault((layer, tensor), AmaxHistory(int(self.cfg.amax_history_len)))
        amax = x.abs().amax().float() if x.numel() else torch.zeros(())  # a tensor: no GPU sync
        if self.sampling():
            self.record(layer, tensor, x, float(amax), history)
        history.push(amax)

    def record(self, layer: str, tensor: str, x: torch.Tensor, amax: float, history: AmaxHistory) -> None:
        fmt = fmt_for(tensor, self.e5m2_saturates)
        for recipe in self.recipes:
            if recipe == "delayed":
                stats = per_tensor_stats(x, history.scale(fmt, self.margin), fmt)
            elif recipe == "current":
                stats = per_tensor_stats(x, float(scale_from_amax(amax, fmt, self.margin)), fmt)
            else:
                stats = block_stats(x, recipe)
            self._writer.record("fp8_debug", step=self.step, layer=layer, tensor=tensor, recipe=recipe,
                                format=fmt.name if recipe in PER_TENSOR else fp4.ELEMENT_FORMAT[recipe].name,
                                cur_amax=amax, numel=x.numel(), **stats)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(exist_ok=True)
            torch.save(x.cpu().clone(), self.dump_dir / f"step{self.step:06d}.{layer}.{tensor}.pt")
