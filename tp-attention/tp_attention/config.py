"""Reading and checking the benchmark's and the parity check's own config keys (without torch:
the command line is checked before it is imported)."""

from __future__ import annotations

from omegaconf import ListConfig

from dtrain.core import nodes as dtrain_config
from dtrain.core.errors import UserError, clip
from dtrain.model.args import GPTConfig
from dtrain.parallel.feasibility import check_tp_heads

IMPLS = ("single", "handrolled", "handrolled_async", "dtensor")
MODULES = ("block", "attention")
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # precision= -> torch dtype name


def as_list(value) -> list:
    """A key that takes one value or a list (`tp=2`, `tp=[1,2]`, sweeps `-m tp=1,2`)."""
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_distinct(key: str, values: list) -> None:
    """A measured list names each value once: a repeat would measure and report it twice (check the
    values' types first: true == 1 in Python)."""
    seen = []
    for value in values:
        if value in seen:
            shown = clip(f"[{', '.join(_show(v) for v in values)}]")
            raise UserError(
                f"{key}={shown} names {clip(_show(value))} twice: each value is "
                "measured once: drop the repeat"
            )
        seen.append(value)


def tp_degrees(cfg) -> list[int]:
    """`train.tp` as a list; null means one group over all ranks. An empty list measures nothing:
    refused."""
    degrees = [cfg.world_size] if cfg.train.tp is None else as_list(cfg.train.tp)
    if not degrees:
        raise UserError(
            f"train.tp=[] is empty: name at least one degree, e.g. train.tp=[1,{cfg.world_size}] "
            "(or train.tp=null for one group over all ranks)"
        )
    return degrees


def check_tp(tp, world_size: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UserError(f"train.tp={tp!r} must be an integer >= 1")
    if tp > world_size:
        raise UserError(
            f"train.tp={tp} is larger than world_size={world_size}: lower train.tp or raise "
            "world_size"
        )


def model_config(cfg) -> GPTConfig:
    """The GPT whose block is measured (`model.preset` + overrides; only the block's fields
    matter)."""
    return dtrain_config.model_config(cfg.model)


def torch_dtype(cfg):
    """The torch dtype of train.precision."""
    import torch

    return getattr(torch, PRECISIONS[cfg.train.precision])


def check_bench(cfg) -> None:
    """Everything the benchmark can reject before a process starts."""
    for key, value in (("train.micro_batch", cfg.train.micro_batch), ("iters", cfg.iters)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{key}={value!r} must be an integer >= 1")
    if cfg.timing_warmup < 0:
        raise UserError(f"timing_warmup={cfg.timing_warmup} must be >= 0")
    if not cfg.profile.enabled or cfg.profile.steps < 1:
        raise UserError(
            f"profile.enabled={cfg.profile.enabled} profile.steps={cfg.profile.steps}: the "
            "guide's communication share needs the profiler: keep profile.enabled=true and "
            "profile.steps >= 1"
        )
    model = model_config(cfg)
    n_kv = model.n_kv_head
    if cfg.module not in MODULES:
        raise UserError(f"module={cfg.module!r} is not one of {', '.join(MODULES)}")
    if cfg.train.precision not in PRECISIONS:
        raise UserError(
            f"train.precision={cfg.train.precision!r} is not one of {', '.join(PRECISIONS)}"
        )
    bad = [i for i in as_list(cfg.impls) if i not in IMPLS]
    if bad:
        raise UserError(f"impls has unknown {bad}: choose from {', '.join(IMPLS)}")
    missing = [i for i in ("handrolled", "single") if i not in as_list(cfg.impls)]
    if missing:
        raise UserError(
            f"impls must include {' and '.join(missing)}: the guide's numbers come from them"
        )
    if not as_list(cfg.train.sequence_parallel):
        raise UserError("train.sequence_parallel=[] is empty: pass false, true or [false,true]")
    for sp in as_list(cfg.train.sequence_parallel):
        if not isinstance(sp, bool):
            raise UserError(f"train.sequence_parallel={sp!r} must be true or false")
    check_distinct("train.sequence_parallel", as_list(cfg.train.sequence_parallel))
    check_distinct("impls", as_list(cfg.impls))
    for tp in tp_degrees(cfg):
        check_tp(tp, cfg.world_size)
    check_distinct("train.tp", tp_degrees(cfg))
    for tp in tp_degrees(cfg):
        check_tp_heads(model.n_head, n_kv, tp)
        if True in as_list(cfg.train.sequence_parallel) and model.seq_len % tp:
            raise UserError(
                f"train.sequence_parallel needs model.seq_len={model.seq_len} divisible by "
                f"tp={tp}: pick model.seq_len a multiple of tp"
            )
