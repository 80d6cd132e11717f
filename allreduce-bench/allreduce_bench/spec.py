"""The user's config, checked and turned into plain values before any rank starts.

Sizes take nccl-tests' suffixes (1K = 1024, 4M, 1G); dtypes take torch names or the usual short
names (fp32, bf16, fp16); everything wrong becomes one UserError line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from omegaconf import DictConfig

from allreduce_bench.alltoallv import SKEWS, Routing
from allreduce_bench.busbw import COLLECTIVES, supports
from dtrain.core.checks import integer_at_least, one_of
from dtrain.core.errors import UserError

# torch's dtype names (torch is imported only by the ranks and by `torch_dtype`: the command line is
# checked first)
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int32",
    "int64",
    "int8",
    "uint8",
    "float8_e4m3fn",
    "float8_e5m2",
)
FLOATING = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
}
# nccl-tests' names for the `type` column
NCCL_TYPE_NAMES = {
    "float32": "float",
    "float16": "half",
    "bfloat16": "bfloat16",
    "float64": "double",
    "int32": "int32",
    "int64": "int64",
    "int8": "int8",
    "uint8": "uint8",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
}
REDOPS = ("sum", "prod", "max", "min", "avg")
MODES = ("out_of_place", "in_place")
_UNITS = {
    "": 1,
    "B": 1,
    "K": 2**10,
    "KB": 2**10,
    "KIB": 2**10,
    "M": 2**20,
    "MB": 2**20,
    "MIB": 2**20,
    "G": 2**30,
    "GB": 2**30,
    "GIB": 2**30,
}


def parse_bytes(value, key: str) -> int:
    """1024, '1K', '4MiB', '1G' -> bytes (binary units, as nccl-tests' -b/-e)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise UserError(
                f"{key}={value!r} is not a size: use bytes or a suffix, e.g. {key}=1K, 4M, 1G"
            )
        n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n < 1:
        raise UserError(f"{key}={value!r} must be at least 1 byte")
    return n


def torch_dtype(name: str):
    """The torch dtype of one of DTYPES."""
    import torch

    return getattr(torch, name)


def dtype_name(value: str) -> str:
    name = ALIASES.get(str(value).lower(), str(value).lower())
    if name not in DTYPES:  # the message names the short spellings too (ALIASES)
        one_of("dtypes", value, (*DTYPES, "fp32", "bf16", "fp16"))
    return name


@dataclass(frozen=True)
class BenchSpec:
    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    redop: str
    modes: tuple[str, ...]
    root: int
    timing_warmup: int
    iters: int
    check: bool
    simulate_nodes: int | None
    inject_wrong: str | None
    routing: Routing = Routing()  # all_to_all_v's routing (alltoallv.py)


def _as_list(value) -> list:
    return [value] if isinstance(value, (str, int)) else list(value)


MAX_SIZES = 64  # sizes per sweep: 1 B .. 16 GiB at factor 2 is 35
MAX_BYTES = 2**36  # 64 GiB per buffer: beyond any GPU's memory


def size_sweep(min_bytes: int, max_bytes: int, factor: float) -> tuple[int, ...]:
    """min, min*f, min*f^2, ... <= max (distinct whole bytes). A factor so close to 1 that the
    sweep would have more than MAX_SIZES sizes is refused instead of running for hours."""
    n = math.floor(math.log(max_bytes / min_bytes, factor) + 1e-9) + 1
    if n > MAX_SIZES:
        raise UserError(
            f"min_bytes={min_bytes}, max_bytes={max_bytes} and step_factor={factor} give {n} sizes "
            f"(at most {MAX_SIZES}): raise step_factor (e.g. 2) or narrow the range"
        )
    sizes, s = [], min_bytes
    while s <= max_bytes:
        if not sizes or int(s) != sizes[-1]:
            sizes.append(int(s))
        s *= factor
    return tuple(sizes)


def parse(cfg: DictConfig) -> BenchSpec:
    collectives = _as_list(cfg.collectives)
    for c in collectives:
        one_of("collectives", c, COLLECTIVES)
    if not collectives:
        raise UserError("collectives=[] is empty: name at least one, e.g. collectives=[all_reduce]")
    if cfg.world_size < 2 and set(collectives) == {
        "sendrecv"
    }:  # every rank sends to the next: needs two
        raise UserError(
            "collectives=[sendrecv] needs world_size >= 2 (each rank sends to the next one): raise "
            "world_size or add another collective"
        )
    lo, hi = parse_bytes(cfg.min_bytes, "min_bytes"), parse_bytes(cfg.max_bytes, "max_bytes")
    if hi > MAX_BYTES:
        raise UserError(
            f"max_bytes={cfg.max_bytes} is larger than {MAX_BYTES // 2**30}G per buffer: lower "
            "max_bytes"
        )
    if lo > hi:
        raise UserError(
            f"min_bytes={cfg.min_bytes} is larger than max_bytes={cfg.max_bytes}: swap them"
        )
    if (
        not isinstance(cfg.step_factor, (int, float))
        or isinstance(cfg.step_factor, bool)
        or not 1 < cfg.step_factor < math.inf
    ):
        raise UserError(
            f"step_factor={cfg.step_factor!r} must be a number > 1 (nccl-tests -f), e.g. "
            "step_factor=2"
        )
    one_of("redop", cfg.redop, REDOPS)
    modes = _as_list(cfg.modes)
    for m in modes:
        one_of("modes", m, MODES)
    if not modes:
        raise UserError("modes=[] is empty: name at least one, e.g. modes=[out_of_place,in_place]")
    for (
        c
    ) in collectives:  # torch has only one of the two modes for some collectives (collectives.py)
        if not any(supports(c, m == "in_place") for m in modes):
            other = "in_place" if "out_of_place" in modes else "out_of_place"
            raise UserError(
                f"collective {c} has no {'/'.join(modes)} form in torch.distributed: "
                f"add {other} to modes, e.g. modes=[out_of_place,in_place]"
            )
    for key in ("iters", "timing_warmup", "root"):
        integer_at_least(key, cfg[key], 1 if key == "iters" else 0)
    if cfg.root >= cfg.world_size:
        raise UserError(
            f"root={cfg.root} is not a rank of world_size={cfg.world_size}: use "
            f"0..{cfg.world_size - 1}"
        )
    nodes = cfg.debug.simulate_nodes
    if nodes is not None and (not isinstance(nodes, int) or nodes < 2 or cfg.world_size % nodes):
        raise UserError(
            f"debug.simulate_nodes={nodes!r} must be an integer >= 2 dividing "
            f"world_size={cfg.world_size}"
        )
    inject = cfg.debug.inject_wrong
    if inject is not None:  # one of the benchmarked collectives, or all of them
        one_of("debug.inject_wrong", inject, (*collectives, "all"))
    routing = _routing(cfg.get("alltoallv"))
    dtypes = _as_list(cfg.dtypes)
    if not dtypes:
        raise UserError("dtypes=[] is empty: name at least one, e.g. dtypes=[float32]")
    return BenchSpec(
        tuple(collectives),
        size_sweep(lo, hi, cfg.step_factor),
        tuple(dtype_name(d) for d in dtypes),
        cfg.redop,
        tuple(modes),
        cfg.root,
        cfg.timing_warmup,
        cfg.iters,
        bool(cfg.check),
        nodes,
        inject,
        routing,
    )


def _routing(node) -> Routing:
    """alltoallv.* as a Routing, each value checked (one line each)."""
    values = {} if node is None else dict(node)
    r = Routing(**values)
    one_of("alltoallv.skew", r.skew, SKEWS)
    for key in ("top_k", "experts_per_rank", "tokens"):
        integer_at_least(f"alltoallv.{key}", getattr(r, key), 1)
    integer_at_least("alltoallv.seed", r.seed, 0)
    if r.top_k > r.experts_per_rank:  # top_k distinct experts, even in a group of one rank
        raise UserError(
            f"alltoallv.top_k={r.top_k} is more than alltoallv.experts_per_rank="
            f"{r.experts_per_rank}: each token picks top_k distinct experts"
        )
    if not 0 < r.zipf_s < math.inf:
        raise UserError(f"alltoallv.zipf_s={r.zipf_s!r} must be a finite number > 0")
    if not 0 < r.hot_share < 1:
        raise UserError(f"alltoallv.hot_share={r.hot_share!r} must be a number in (0, 1)")
    return r


def known_unsupported(backend: str, dtype: str, redop: str, collectives) -> str | None:
    """Combinations we know fail (checked in torch 2.13), caught before any rank starts; the ranks
    still catch anything else at the first size."""
    if backend == "gloo" and dtype.startswith("float8"):
        return (
            f'backend=gloo cannot move {dtype} tensors ("Invalid scalar type"): use '
            "dtypes=[float32] or run on GPUs with NCCL"
        )
    reduces = any(c in ("all_reduce", "reduce_scatter", "reduce") for c in collectives)
    if backend == "gloo" and reduces and redop == "avg" and dtype not in FLOATING:
        return (
            f"backend=gloo cannot reduce {dtype} with redop=avg: use a floating dtype or redop=sum"
        )
    return None
