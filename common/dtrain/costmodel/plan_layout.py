"""`dtrain plan --layout`: the fields it pins (``parse_layout``), checked against the trainer's
rules and the --software (``pinned_layout``), and the layout scored against the best
(``layout_result``)."""

from __future__ import annotations

import math

from dtrain.core.checks import one_of
from dtrain.core.errors import UserError

from .software import software, unsupported
from .shapes import CP_IMPLS, PP_SCHEDULES, PP_SPLITS, RECOMPUTE, ModelShape, parallel_refusal
from .search import SearchResult, search
from .plan_inputs import stack_of


LAYOUT_KEYS = {
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "v": "virtual_stages",
    "zero": "zero_stage",
    "recompute": "recompute",
    "mb": "micro_batch",
    "sp": "sequence_parallel",
    "schedule": "pp_schedule",
    "cp": "cp",
    "cp_impl": "cp_impl",
    "hsdp": "dp_replicate",
    "split": "pp_split",
    "ep": "ep",  # MoE plans (--experts) only
    "etp": "etp",
}
LAYOUT_CHOICES = {
    "recompute": RECOMPUTE,
    "cp_impl": CP_IMPLS,
    "pp_split": PP_SPLITS,
    "pp_schedule": PP_SCHEDULES,
}


def parse_layout(text: str, gpus: int | None = None) -> dict:
    """'tp=8 pp=16 v=8 zero=1 recompute=selective mb=1' -> search(fixed=...) fields; UserError on
    bad input (an unknown or repeated field, a value out of range, dp·tp·pp that cannot make
    `gpus`, v without pp)."""
    fixed = {}
    for item in text.replace(",", " ").split():
        key, eq, value = item.partition("=")
        if not eq or key not in LAYOUT_KEYS:
            raise UserError(
                f"--layout: {item!r} is not one of {', '.join(k + '=' for k in LAYOUT_KEYS)} "
                '(e.g. --layout "tp=8 pp=16 v=8 zero=1 recompute=selective mb=1")'
            )
        field = LAYOUT_KEYS[key]
        if field in fixed:
            raise UserError(f"--layout: {key}= is given twice: give each field once")
        if field in LAYOUT_CHOICES:
            one_of(f"--layout: {key}", value, LAYOUT_CHOICES[field])
            fixed[field] = value
        elif field == "sequence_parallel":
            if value not in ("on", "off", "1", "0", "true", "false"):
                raise UserError(f"--layout: sp={value} must be on or off")
            fixed[field] = value in ("on", "1", "true")
        else:
            try:
                fixed[field] = int(value)
            except ValueError:
                raise UserError(f"--layout: {key}={value} must be an integer") from None
            if fixed[field] < (0 if field == "zero_stage" else 1) or (
                field == "zero_stage" and fixed[field] > 3
            ):
                raise UserError(
                    f"--layout: {key}={value} is out of range (zero 0..3, the others >= 1)"
                )
    if not fixed:
        raise UserError(
            f'--layout {text!r} is empty: give fields like "tp=8 pp=2 zero=1 mb=1" '
            "or leave --layout out"
        )
    if fixed.get("virtual_stages", 1) > 1 and fixed.get("pp", 2) < 2:
        raise UserError(
            f"--layout: v={fixed['virtual_stages']} interleaves pipeline stages but pp=1: "
            "drop v= or give pp >= 2"
        )
    dims = {k: fixed[k] for k in ("dp", "cp", "tp", "pp") if k in fixed}
    product = math.prod(dims.values())
    whole = (
        len(dims) == 4
    )  # with cp left free, dp·tp·pp need only divide the GPUs (cp takes the rest)
    if gpus is not None and (gpus % product or (whole and product != gpus)):
        given = "·".join(f"{k}={v}" for k, v in dims.items())
        raise UserError(
            f"--layout: {given} = {product} {'does not divide' if gpus % product else 'is not'} "
            f"--gpus {gpus}: dp·cp·tp·pp must equal the GPUs"
        )
    if fixed.get("pp_split", "layers") != "layers" and fixed.get("pp", 2) < 2:
        raise UserError(
            f"--layout: split={fixed['pp_split']} splits layers over pipeline stages but pp=1: "
            "drop split= or give pp >= 2"
        )
    if fixed.get("cp_impl") and fixed.get("cp", 2) < 2:
        raise UserError(f"--layout: cp_impl={fixed['cp_impl']} needs cp >= 2")
    replicas = fixed.get("dp_replicate", 1)
    if replicas > 1:
        if fixed.setdefault("zero_stage", 3) < 2:
            raise UserError(
                f"--layout: hsdp={replicas} shards with FSDP inside each replica group: "
                f"give zero=3 (or 2), not zero={fixed['zero_stage']}"
            )
        dp = fixed.get(
            "dp", 0
        )  # dp = dp_replicate x dp_shard (dtrain.core.layout), as the trainer splits it
        if dp and dp % replicas:
            raise UserError(
                f"--layout: hsdp={replicas} replica groups do not divide dp = {dp}: "
                "give a divisor of dp"
            )
    return fixed


def pinned_layout(a, gpus: int, shape) -> dict | None:
    """The --layout fields (``parse_layout``) checked against --software for the model (its
    layers and KV heads), before any search; None without it."""
    if a.layout is None:  # --layout "" is refused by parse_layout, not taken for no layout
        return None
    fixed = parse_layout(a.layout, gpus)
    why = layout_refusal(shape, fixed)
    if why:
        raise UserError(f"--layout {a.layout!r}: {why}")
    lacks = unsupported(software(a.software), fixed, shape.n_layer, shape.n_kv_head)
    if lacks:
        raise UserError(
            f"--layout: {a.software} does not run {lacks}: change --layout, or pass the --software "
            "that runs it (--software any scores every layout)"
        )
    return fixed


def layout_refusal(shape: ModelShape, fixed: dict) -> str | None:
    """Why the trainer's rules (``shapes.parallel_refusal``) refuse the tp, cp, cp_impl and sp that
    --layout pins for this model; None when they allow them. Fields left out are searched, and the
    search skips the values that break a rule."""
    tp, cp = fixed.get("tp", 1), fixed.get("cp", 1)
    sp = "tp" in fixed and fixed.get("sequence_parallel", False)
    return parallel_refusal(shape, tp, cp, fixed.get("cp_impl", "ring"), sp)


def layout_result(shape, cluster, a, calib, best: SearchResult, fixed: dict | None):
    """(search restricted to the --layout fields ``fixed``, its gap to ``best``, tight) or (None,
    None, False) without --layout.

    The headroom is for choosing: a layout the user gives is judged against the whole HBM. When
    it fits only in the share ``--headroom`` keeps free it is still scored (published layouts run
    there: torchtitan's Llama 3.1 8B on 8 H100 peaks at 77 of 80 GiB), marked ``tight``; one that
    does not fit is said against the whole HBM."""
    if fixed is None:
        return None, None, False
    kw = dict(precision=a.precision, stack=stack_of(a), fixed=fixed)
    res = search(shape, cluster, a.global_batch, calib, headroom=a.headroom, **kw)
    tight = False
    if res.best is None and a.headroom > 0:
        res = search(shape, cluster, a.global_batch, calib, headroom=0.0, **kw)
        tight = res.best is not None
    if res.best is None or best.best is None:
        return res, None, tight
    return res, 100 * (1 - res.best.time.tokens_per_s / best.best.time.tokens_per_s), tight
