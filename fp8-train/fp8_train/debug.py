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
    """Quantization error of one round trip. Element-wise work stays in x's dtype (x - deq is exact
    in float32: the two are within a factor of 2, or deq is 0); every reduction accumulates in
    float64. Cosine comes from three norms, cos = (|x|^2 + |d|^2 - |x-d|^2) / (2 |x| |d|), and all
    sums are read back in one sync."""
    x, deq = x.detach().reshape(-1).float(), deq.detach().reshape(-1).float()
    nonzero = x != 0
    f64 = torch.float64
    sums = torch.stack([(nonzero & (deq == 0)).sum(dtype=f64), nonzero.sum(dtype=f64),
                        (scaled.detach().abs() > fmt.max).sum(dtype=f64),
                        torch.linalg.vector_norm(x - deq, dtype=f64) ** 2,
                        torch.linalg.vector_norm(x, dtype=f64) ** 2, torch.linalg.vector_norm(deq, dtype=f64) ** 2])
    underflow, n_nonzero, overflow, err, power, dpower = sums.tolist()
    n = max(1, x.numel())
    denom = 2 * math.sqrt(power * dpower)
    cos = (power + dpower - err) / denom if denom > 0 else (1.0 if err == 0 else 0.0)
    return {"underflows_pct": 100.0 * underflow / max(1.0, n_nonzero), "overflows_pct": 100.0 * overflow / n,
            "mse": err / n, "rel_mse": err / power if power > 0 else 0.0, "cos_sim": cos}


def per_tensor_stats(x: torch.Tensor, scale: float, fmt: Format, sample: torch.Tensor | None = None) -> dict:
    """Stats of the scaled round trip. With `sample` (flat indices), underflow, mse and cosine are
    estimated on those elements; the overflow count is always exact over the whole tensor."""
    xf = x.detach().reshape(-1).float()
    part = xf if sample is None else xf[sample]
    stats = roundtrip_stats(part, quantize(part, scale, fmt), part[:0], fmt)
    stats["overflows_pct"] = 100.0 * float((xf.abs() > fmt.max / scale).sum()) / max(1, xf.numel())
    return {"scale": float(scale), **stats}


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
        self.sample_elements = int(cfg.get("sample_elements", 0) or 0)
        self._samples: dict[int, torch.Tensor] = {}
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
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and hasattr(module, "in_features") \
                    and self.pattern.fullmatch(name):
                module.register_forward_hook(self._forward_hook(name))
                self.layers.append(name)
                if getattr(module, "scaling", None) == "delayed":
                    self.own_scalers[name] = module
        self._writer.event("debug_layers", layers=self.layers, freq=self.freq, tensors=self.tensors,
                           recipes=self.recipes)

    def on_step_start(self, trainer, step: int) -> None:
        self.step = step

    def sampling(self) -> bool:
        return self.freq > 0 and self.step % self.freq == 0

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not torch.is_grad_enabled() or (name in self.own_scalers and not self.sampling()):
                return  # an emulated delayed layer keeps its own amax history: nothing to track
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

    def sample_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """A fixed random subset of flat indices (one per tensor size), or None for all elements."""
        n = x.numel()
        if not self.sample_elements or n <= self.sample_elements:
            return None
        if n not in self._samples:
            gen = torch.Generator().manual_seed(n)
            self._samples[n] = torch.randperm(n, generator=gen)[: self.sample_elements].to(x.device)
        return self._samples[n]

    def delayed_scale(self, layer: str, tensor: str, fmt: Format, history: AmaxHistory) -> float:
        """The scale delayed scaling uses for this cast: the layer's own (emulated delayed layers;
        forward hooks run after the cast, the gradient hook before it) or the tracked history's."""
        module = self.own_scalers.get(layer)
        if module is None:
            return history.scale(fmt, self.margin)
        if tensor == "gradient":
            return float(module.grad_scaler.scale)
        return float((module.input_scaler if tensor == "activation" else module.weight_scaler).last_used)

    def record(self, layer: str, tensor: str, x: torch.Tensor, amax: float, history: AmaxHistory) -> None:
        fmt = fmt_for(tensor, self.e5m2_saturates)
        sample = self.sample_of(x)
        for recipe in self.recipes:
            if recipe == "delayed":
                stats = per_tensor_stats(x, self.delayed_scale(layer, tensor, fmt, history), fmt, sample)
            elif recipe == "current":
                stats = per_tensor_stats(x, float(scale_from_amax(amax, fmt, self.margin)), fmt, sample)
            else:
                stats = block_stats(x, recipe)
            self._writer.record("fp8_debug", step=self.step, layer=layer, tensor=tensor, recipe=recipe,
                                format=fmt.name if recipe in PER_TENSOR else fp4.ELEMENT_FORMAT[recipe].name,
                                cur_amax=amax, numel=x.numel(), sampled=sample is not None, **stats)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(exist_ok=True)
            torch.save(x.cpu().clone(), self.dump_dir / f"step{self.step:06d}.{layer}.{tensor}.pt")
