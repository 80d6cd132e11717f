"""Each GPU's kernel rates, read from ``kernels.yaml`` (``published``): the GEMM curve per dtype,
fused attention's share of the peak by sequence length and head dim, the memory-bound kernels'
shares of HBM bandwidth, sustained clocks and the board power (``KernelModel``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources

import yaml

from .efficiency import GemmCurve
from .hashing import cached_hash


@dataclass(frozen=True)
class AttentionCurve:
    """Fused attention forward+backward share of the bf16 peak: e(s) = e_max·s/(s + s_half)."""

    __hash__ = cached_hash

    e_max: float
    s_half: float
    hd64: float = 0.8
    # time multiplier of dropout on the probabilities inside the kernel (kernels.yaml, measured)
    dropout: float = 1.0

    def share(self, seq: int, head_dim: int) -> float:
        e = self.e_max * seq / (seq + self.s_half)
        return e * (self.hd64 if head_dim <= 64 else 1.0)


class FrozenMap(tuple):
    """A hashable read-only mapping (sorted (key, value) pairs), so a KernelModel can key a
    cache."""

    def __new__(cls, d: dict | None = None):
        obj = super().__new__(cls, sorted((d or {}).items()))
        obj._d = dict(obj)
        return obj

    def get(self, key, default=None):
        return self._d.get(key, default)

    def __getitem__(self, key):
        return tuple.__getitem__(self, key) if isinstance(key, int) else self._d[key]

    def __contains__(self, key) -> bool:
        return key in self._d

    def as_dict(self) -> dict:
        return dict(self._d)


@dataclass(frozen=True)
class KernelModel:
    """How fast one device runs each kind of kernel (``kernels.yaml``); ``memory`` None:
    memory-bound work is not modelled (a measured fixed overhead covers it), ``attention`` None:
    batched GEMMs."""

    __hash__ = cached_hash

    name: str
    gemm: FrozenMap  # dtype -> GemmCurve
    attention: AttentionCurve | None = None
    memory: FrozenMap | None = None  # kernel kind -> share of HBM bandwidth
    power_w: float | None = None
    sustained: float = (
        1.0  # share of the benchmark rate kept under continuous load (GEMM, attention)
    )
    sources: FrozenMap = field(default_factory=FrozenMap)
    gemm_measured: bool = (
        False  # the GEMM curve was measured on this GPU (gemm-probe): its clocks are in it
    )
    idle_w: float = 0.0  # board draw at idle, which a lower power cap cannot take from (W)
    # kernel kind -> ((row width, share of HBM bandwidth), ...) ascending: kernels.yaml by_width
    memory_by_width: FrozenMap = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        for name in ("gemm", "memory", "sources", "memory_by_width"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, FrozenMap(value))

    def with_gemm(self, dtype: str, curve: GemmCurve, source: str) -> KernelModel:
        return replace(
            self,
            gemm={**self.gemm.as_dict(), dtype: curve},
            sources={**self.sources.as_dict(), f"gemm_{dtype}": source},
            gemm_measured=True,
        )

    def memory_share(self, kind: str, width: float | None = None) -> float:
        """The share of HBM bandwidth a memory-bound kernel of ``kind`` reaches: at ``width``
        (the rows it walks) where the table has the kind by width, interpolated in log2(width)
        between the measured widths and held at the end values beyond them; else the median of
        the widths."""
        points = self.memory_by_width.get(kind) if width else None
        if not points:
            return self.memory[kind]
        if width <= points[0][0]:
            return points[0][1]
        for (w0, s0), (w1, s1) in zip(points, points[1:]):
            if width <= w1:
                f = math.log2(width / w0) / math.log2(w1 / w0)
                return s0 + f * (s1 - s0)
        return points[-1][1]

    def power_scale(self, cap_w: float | None) -> float:
        """Time multiplier of compute-bound kernels under a board power cap below the table's:
        dynamic power ~ f·V² with V ~ f, so the clock falls as the cube root of the power above
        the idle draw."""
        if not (self.power_w and cap_w and cap_w < self.power_w):
            return 1.0
        return ((self.power_w - self.idle_w) / (cap_w - self.idle_w)) ** (1 / 3)


@lru_cache(maxsize=1)
def _table() -> dict:
    return yaml.safe_load(
        resources.files(__package__).joinpath("kernels.yaml").read_text(encoding="utf-8")
    )


@lru_cache(maxsize=64)
def published(gpu: str, attention: str = "flash") -> KernelModel | None:
    """The kernel table of a ``hardware.yaml`` profile (its ``attention`` kernel: flash | flash2
    | eager), None for a device without one."""
    e = _table().get(gpu)
    if e is None:
        return None
    gemm = {
        d: GemmCurve(c["e_max"], c["w_half_gflop"] * 1e9)
        for d in ("bf16", "fp8")
        if (c := e.get(f"gemm_{d}"))
    }
    a = e["attention"]["flash2" if attention == "flash2" else "flash"]
    curve = (
        None
        if attention == "eager"
        else AttentionCurve(a["e_max"], a["s_half"], a.get("hd64", 0.8), a.get("dropout", 1.0))
    )
    mem = {k: v for k, v in e["memory"].items() if k not in ("source", "by_width")}
    by_width = {
        kind: tuple(sorted((float(w), float(v)) for w, v in points.items()))
        for kind, points in (e["memory"].get("by_width") or {}).items()
    }
    return KernelModel(
        gpu,
        gemm,
        curve,
        mem,
        e.get("power_w"),
        e.get("sustained", 1.0),
        {
            "gemm": e["gemm_source"],
            "attention": a["source"],
            "memory": e["memory"]["source"],
            "sustained": e.get("sustained_source", ""),
            "idle": e.get("idle_source", ""),
        },
        idle_w=e.get("idle_w", 0.0),
        memory_by_width=by_width,
    )
