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
the others. On a sampled step a hook only takes |x|, its amax and the sampled elements (copies)
and the delayed scale as a tensor; after backward (`after_backward`) all pending tensors of one
format are done as one batch: scales of every tensor x recipe at once, one overflow compare per
tensor, every round trip in one (elements x recipes) pass with per-tensor sums by `index_add_`,
and one read-back (`.tolist()`, one sync) per format. Past `PENDING_LIMIT` held elements the
batch runs at once, so the copies stay bounded for big tensors.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dtrain.train import Callback
from fp8_train import fp4
from fp8_train.formats import E4M3, E5M2, Format, quantize
from fp8_train.scaling import amax_of, scale_from_amax

TENSORS = ("activation", "weight", "gradient")
PER_TENSOR = ("delayed", "current")
RECIPES = PER_TENSOR + fp4.BLOCK_RECIPES
F64 = torch.float64
PENDING_LIMIT = 1 << 24  # elements held (|x| + sampled copies) before a batch runs


def fmt_for(tensor: str, e5m2_saturates: bool = True) -> Format:
    if tensor == "gradient":
        return replace(E5M2, saturate=True) if e5m2_saturates else E5M2
    return E4M3


def _stats(underflow, n_nonzero, overflow, err, power, dpower, n: int, n_overflow: int) -> dict:
    """The record's numbers from the float64 sums of one round trip (n elements; the overflow
    count is over n_overflow elements). Cosine from three norms: (|x|^2 + |d|^2 - |x-d|^2) / 2|x||d|."""
    n = max(1, n)
    denom = 2 * math.sqrt(power * dpower)
    cos = (power + dpower - err) / denom if denom > 0 else (1.0 if err == 0 else 0.0)
    return {"underflows_pct": 100.0 * underflow / max(1.0, n_nonzero), "overflows_pct": 100.0 * overflow / max(1, n_overflow),
            "mse": err / n, "rel_mse": err / power if power > 0 else 0.0, "cos_sim": cos}


def roundtrip_stats(x: torch.Tensor, deq: torch.Tensor, scaled: torch.Tensor, fmt: Format) -> dict:
    """Quantization error of one round trip. Element-wise work stays in x's dtype (x - deq is exact
    in float32: the two are within a factor of 2, or deq is 0); every reduction accumulates in
    float64, and all sums are read back in one sync."""
    x, deq = x.detach().reshape(-1).float(), deq.detach().reshape(-1).float()
    nonzero = x != 0
    sums = torch.stack([(nonzero & (deq == 0)).sum(dtype=F64), nonzero.sum(dtype=F64),
                        (scaled.detach().abs() > fmt.max).sum(dtype=F64),
                        torch.linalg.vector_norm(x - deq, dtype=F64) ** 2,
                        torch.linalg.vector_norm(x, dtype=F64) ** 2, torch.linalg.vector_norm(deq, dtype=F64) ** 2])
    underflow, n_nonzero, overflow, err, power, dpower = sums.tolist()
    return _stats(underflow, n_nonzero, overflow, err, power, dpower, x.numel(), x.numel())


def _decoded(codes: torch.Tensor) -> torch.Tensor:
    """FP8 codes -> float32 through a 256-entry table: the same values as .float(), which is a slow
    scalar loop on CPU (~6x slower here)."""
    key = (codes.dtype, codes.device)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(256, dtype=torch.uint8, device=codes.device).view(codes.dtype).float()
    return _TABLES[key].index_select(0, codes.view(torch.uint8).reshape(-1).int()).view(codes.shape)


_TABLES: dict = {}


def roundtrip(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """formats.quantize(x, scale, fmt) (float32), with a faster decode for the FP8 formats."""
    if fmt.dtype is None:
        return quantize(x, scale, fmt)
    y = x * scale
    if fmt.saturate:
        y = y.clamp_(-fmt.max, fmt.max)
    return _decoded(y.to(fmt.dtype)) / scale


def count(ones: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of 0/1 values: in float32 (exact up to 2**24 elements, and ~15x faster here than a
    float64 reduction), in float64 past that."""
    n = ones.numel() if dim is None else ones.shape[dim]
    kw = {} if n <= 2**24 else {"dtype": F64}
    return ones.sum(**kw) if dim is None else ones.sum(dim, **kw)


def count_nonzero(t: torch.Tensor) -> torch.Tensor:
    """(t != 0).sum(-1), NaN counted as non-zero, without a bool tensor (comparisons into bool
    are ~10x slower than arithmetic here)."""
    return count(t.sign().abs_().nan_to_num_(nan=1.0), -1)


def count_above(t: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """(t > threshold).sum() for t >= 0: a > b gives a - b > 0 (gradual underflow), and NaN - b,
    inf - inf are NaN, not counted, as NaN > b and inf > inf are false."""
    return count((t - threshold).clamp_(min=0).sign_().nan_to_num_(nan=0.0))


def batch_roundtrip(x: torch.Tensor, scales: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The sums of many scaled round trips in one pass: row x[i] (float32, (T, L)) is cast with
    each scales[i, r] ((T, R) float32). Returns (T, 2 + 3R) float64 sums, per row:
    [non-zeros, |x|^2, underflows (R), |x - deq|^2 (R), |deq|^2 (R)]. x == 0 gives deq == 0, so
    the underflows (non-zero x, zero deq) are non-zeros(x) - non-zeros(deq)."""
    deq = roundtrip(x[:, None, :], scales[:, :, None], fmt)  # (T, R, L)
    nonzero = count_nonzero(x)
    norm2 = lambda t: torch.linalg.vector_norm(t, dim=-1, dtype=F64) ** 2  # noqa: E731
    return torch.cat([nonzero[:, None].to(F64), norm2(x)[:, None], (nonzero[:, None] - count_nonzero(deq)).to(F64),
                      norm2(x[:, None, :] - deq), norm2(deq)], 1)


def overflow_thresholds(scales: torch.Tensor, fmt: Format) -> torch.Tensor:
    """|x| > max / scale (float64 division, compared in float32, as `x > python_float` does)."""
    return (fmt.max / scales.to(F64)).float()


def per_tensor_stats(x: torch.Tensor, scale, fmt: Format, sample: torch.Tensor | None = None) -> dict:
    """Stats of the scaled round trip. With `sample` (flat indices), underflow, mse and cosine are
    estimated on those elements; the overflow count is always exact over the whole tensor."""
    xf = x.detach().reshape(-1).float()
    part = xf if sample is None else xf[sample]
    s = torch.as_tensor(scale, dtype=torch.float32, device=xf.device).reshape(1, 1)
    n_nonzero, power, underflow, err, dpower = batch_roundtrip(part[None], s, fmt)[0].tolist()
    overflow = float((xf.abs() > overflow_thresholds(s, fmt)[0, 0]).sum())
    return {"scale": float(s), **_stats(underflow, n_nonzero, overflow, err, power, dpower, part.numel(), xf.numel())}


def block_stats(x: torch.Tensor, recipe: str) -> dict:
    q = fp4.block_quantize(x.detach().float(), recipe)
    return {"scale": None, **roundtrip_stats(x, q.dequantized, q.scaled, q.fmt)}


class AmaxHistory:
    """The history TE's delayed scaling would keep for one tensor (newest last, 0-d tensors)."""

    def __init__(self, length: int):
        self.length, self.values = length, []

    def amax(self, device=None) -> torch.Tensor:
        return torch.stack(self.values).max() if self.values else torch.zeros((), device=device)

    def scale(self, fmt: Format, margin: int) -> float:
        return float(scale_from_amax(self.amax(), fmt, margin))  # no history yet: scale 1, as TE starts

    def push(self, amax: torch.Tensor) -> None:
        self.values = (self.values + [amax])[-self.length:]


@dataclass
class Pending:
    """One sampled tensor, waiting for its format's batch."""
    step: int
    layer: str
    tensor: str
    fmt: Format
    numel: int
    ax: torch.Tensor                     # |x|, flat float32, a copy (overflow counts)
    part: torch.Tensor                   # the round trip's elements, a copy
    amax: torch.Tensor                   # 0-d float32
    own_scale: torch.Tensor | None       # delayed scale of an emulated delayed layer ...
    history_amax: torch.Tensor | None    # ... or the tracked history's amax before this step
    sampled: bool
    x: torch.Tensor | None = None        # the tensor itself, only for block recipes


class DebugTool(Callback):
    def __init__(self, cfg, run_dir: Path, rank: int):
        self.cfg = cfg
        self.freq, self.margin = int(cfg.freq), int(cfg.margin)
        self.e5m2_saturates = cfg.get("e5m2_overflow", "saturate") == "saturate"
        self.pattern = re.compile(cfg.layers.layer_name_regex_pattern)
        self.tensors = [t for t in cfg.tensors if t in TENSORS]
        self.recipes = [r for r in cfg.recipes if r in RECIPES]
        self.per_tensor = [r for r in self.recipes if r in PER_TENSOR]
        self.formats = {t: fmt_for(t, self.e5m2_saturates) for t in TENSORS}
        self.active = bool(cfg.enabled) and rank == 0
        self.dump_dir = Path(run_dir) / "dumps" if cfg.dump_tensors else None
        self.histories: dict[tuple[str, str], AmaxHistory] = {}
        self.sample_elements = int(cfg.get("sample_elements", 0) or 0)
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

    def after_backward(self, trainer, step: int) -> None:
        self.flush()

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        self.flush()  # anything observed after backward (nothing, in the Trainer's loop)

    def on_train_end(self, trainer) -> None:
        self.flush()

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
        own = layer in self.own_scalers
        history = None if own else self.histories.setdefault((layer, tensor), AmaxHistory(int(self.cfg.amax_history_len)))
        if not self.sampling():
            history.push(amax_of(x))  # a tensor: no GPU sync
            return
        xf = x.reshape(-1).float()
        ax = xf.abs()
        amax = ax.amax() if xf.numel() else torch.zeros((), device=x.device)
        sample = self.sample_of(xf)
        part = xf.index_select(0, sample) if sample is not None else (xf.clone() if x.dtype == torch.float32 else xf)
        self.pending.append(Pending(
            self.step, layer, tensor, self.formats[tensor], xf.numel(), ax, part, amax,
            self.own_scale(layer, tensor) if own else None, None if own else history.amax(x.device),
            sample is not None, x.clone() if len(self.per_tensor) < len(self.recipes) else None))
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
            return module.grad_scaler.scale.detach().clone()
        return (module.input_scaler if tensor == "activation" else module.weight_scaler).last_used.detach()

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
                self._writer.record("fp8_debug", step=p.step, layer=p.layer, tensor=p.tensor, recipe=recipe,
                                    format=p.fmt.name if recipe in PER_TENSOR else fp4.ELEMENT_FORMAT[recipe].name,
                                    cur_amax=amax, numel=p.numel, sampled=p.sampled, **s)

    def _batch(self, fmt: Format, ps: list[Pending]) -> list[tuple[float, dict]]:
        """(cur_amax, {recipe: stats}) for each of ps, all tensors and per-tensor recipes at once."""
        amax = torch.stack([p.amax for p in ps]).float()
        if not self.per_tensor:
            return [(a, {}) for a in amax.tolist()]
        columns = {}
        if "current" in self.per_tensor:
            columns["current"] = scale_from_amax(amax, fmt, self.margin)
        if "delayed" in self.per_tensor:
            from_history = torch.tensor([p.own_scale is None for p in ps], device=amax.device)
            history_amax = torch.stack([p.amax if p.history_amax is None else p.history_amax for p in ps]).float()
            own = torch.stack([p.amax if p.own_scale is None else p.own_scale for p in ps]).float()
            columns["delayed"] = torch.where(from_history, scale_from_amax(history_amax, fmt, self.margin), own)
        R, T = len(self.per_tensor), len(ps)
        scales = torch.stack([columns[r] for r in self.per_tensor], 1)  # (T, R)
        thresholds = overflow_thresholds(scales, fmt)
        head = torch.cat([amax[:, None], scales, thresholds], 1).tolist()  # sync 1 of 2
        # overflow counts, exact over the whole tensor; 0 without counting where amax <= threshold
        count_at = [(i, r) for i, row in enumerate(head) for r in range(R) if not row[0] <= row[1 + R + r]]
        counts = [count_above(ps[i].ax, thresholds[i, r]) for i, r in count_at]
        by_length: dict[int, list[int]] = {}  # round trips: one batch per part length
        for i, p in enumerate(ps):
            by_length.setdefault(p.part.numel(), []).append(i)
        order = [i for rows in by_length.values() for i in rows]
        sums = [batch_roundtrip(torch.stack([ps[i].part for i in rows]),
                                scales[torch.tensor(rows, device=scales.device)], fmt) for rows in by_length.values()]
        flat = torch.cat([s.reshape(-1) for s in sums] + [torch.stack(counts).to(F64) if counts else scales.new_zeros(0, dtype=F64)])
        flat = flat.tolist()  # sync 2 of 2
        K = 2 + 3 * R
        table = {i: flat[j * K:(j + 1) * K] for j, i in enumerate(order)}
        overflow = {(i, r): flat[T * K + j] for j, (i, r) in enumerate(count_at)}
        out = []
        for i, p in enumerate(ps):
            n_nonzero, power, *rest = table[i]
            out.append((head[i][0], {r: {"scale": head[i][1 + k], **_stats(
                rest[k], n_nonzero, overflow.get((i, k), 0.0), rest[R + k], power, rest[2 * R + k], p.part.numel(), p.numel)}
                for k, r in enumerate(self.per_tensor)}))
        return out
