"""Reading and checking the benchmark's and the parity check's own config keys."""
from __future__ import annotations

from omegaconf import ListConfig

from dtrain.errors import UserError
from dtrain.parallel.tp.attention import check_tp_heads

IMPLS = ("single", "handrolled", "handrolled_async", "dtensor")
MODULES = ("block", "attention")
DTYPES = ("float32", "bfloat16")


def as_list(value) -> list:
    """A key that takes one value or a list (`tp=2`, `tp=[1,2]`, sweeps `-m tp=1,2`)."""
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


def tp_degrees(cfg) -> list[int]:
    """`tp` as a list; null means one group over all ranks."""
    return [cfg.world_size] if cfg.tp is None else as_list(cfg.tp)


def check_tp(tp, world_size: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UserError(f"tp={tp!r} must be an integer >= 1")
    if tp > world_size:
        raise UserError(f"tp={tp} is larger than world_size={world_size}: lower tp or raise world_size")


def check_bench(cfg) -> None:
    """Everything the benchmark can reject before a process starts."""
    for key in ("batch", "seq", "d_model", "n_head", "iters"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise UserError(f"{key}={cfg[key]!r} must be an integer >= 1")
    if cfg.n_kv_head is not None and (not isinstance(cfg.n_kv_head, int) or cfg.n_kv_head < 1):
        raise UserError(f"n_kv_head={cfg.n_kv_head!r} must be an integer >= 1 (or null = n_head)")
    if cfg.warmup < 0:
        raise UserError(f"warmup={cfg.warmup} must be >= 0")
    n_kv = cfg.n_kv_head or cfg.n_head
    if cfg.d_model % cfg.n_head:
        raise UserError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}: pick d_model = n_head * head_dim")
    if cfg.module not in MODULES:
        raise UserError(f"module={cfg.module!r} is not one of {', '.join(MODULES)}")
    if cfg.dtype not in DTYPES:
        raise UserError(f"dtype={cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    bad = [i for i in as_list(cfg.impls) if i not in IMPLS]
    if bad:
        raise UserError(f"impls has unknown {bad}: choose from {', '.join(IMPLS)}")
    missing = [i for i in ("handrolled", "single") if i not in as_list(cfg.impls)]
    if missing:
        raise UserError(f"impls must include {' and '.join(missing)}: the guide's numbers come from them")
    for sp in as_list(cfg.sequence_parallel):
        if not isinstance(sp, bool):
            raise UserError(f"sequence_parallel={sp!r} must be true or false")
    for tp in tp_degrees(cfg):
        check_tp(tp, cfg.world_size)
        check_tp_heads(cfg.n_head, n_kv, tp)
        if True in as_list(cfg.sequence_parallel) and cfg.seq % tp:
            raise UserError(f"sequence_parallel needs seq={cfg.seq} divisible by tp={tp}: pick seq a multiple of tp")
