"""`python -m tp_attention.cp`: context-parallel attention, hand-rolled ring and all-to-all, against
one device and against TP with sequence parallelism, over sequence lengths and cp degrees.

    python -m tp_attention.cp                                   # cp=2 on 2 CPU ranks, s = 256, 512,
                                                                1024
    python -m tp_attention.cp world_size=4 train.cp=[2,4] 'model.seq_len=[1024,2048]'
"""

from __future__ import annotations

from dtrain.core.errors import UserError
from dtrain.run.app import hydra_main
from tp_attention.config import PRECISIONS, as_list, check_distinct
from tp_attention.cp.bench import cp_degrees, model_at, rank_fn, seq_lens
from tp_attention.cp.report import finalize

CP_IMPLS = ("ring", "ulysses")


def validate(cfg) -> None:
    """Everything the study can reject before a process starts."""
    for key, value, low in (
        ("train.micro_batch", cfg.train.micro_batch, 1),
        ("iters", cfg.iters, 1),
        ("timing_warmup", cfg.timing_warmup, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UserError(f"{key}={value!r} must be an integer >= {low}")
    if cfg.train.precision not in PRECISIONS:
        raise UserError(
            f"train.precision={cfg.train.precision!r} is not one of {', '.join(PRECISIONS)}"
        )
    impls = as_list(cfg.train.cp_impl)
    bad = [i for i in impls if i not in CP_IMPLS]
    if bad or not impls:
        raise UserError(f"train.cp_impl={impls} must name at least one of {', '.join(CP_IMPLS)}")
    check_distinct("train.cp_impl", impls)
    degrees, lengths = cp_degrees(cfg), seq_lens(cfg)
    if not degrees or not lengths:
        raise UserError(
            "train.cp and model.seq_len must each name at least one value, e.g. train.cp=[2] "
            "'model.seq_len=[256,1024]'"
        )
    for cp in degrees:
        if not isinstance(cp, int) or isinstance(cp, bool) or not 2 <= cp <= cfg.world_size:
            raise UserError(
                f"train.cp={cp!r} must be an integer in [2, world_size={cfg.world_size}] (cp=1 is "
                "the one-device baseline, always measured)"
            )
    check_distinct("train.cp", degrees)
    for s in lengths:
        if not isinstance(s, int) or isinstance(s, bool):
            raise UserError(f"model.seq_len={s!r} must be an integer")
    check_distinct("model.seq_len", lengths)
    for s in lengths:
        m = model_at(cfg, s)
        for cp in degrees:
            if s % (2 * cp):
                raise UserError(
                    f"model.seq_len={s} is not divisible by 2 x train.cp = {2 * cp} (each rank "
                    "holds 2 of 2·cp chunks): pick lengths that are multiples of "
                    f"{2 * max(degrees)}"
                )
            if "ulysses" in impls and m.n_head % cp:
                raise UserError(
                    f"train.cp_impl=ulysses needs model.n_head={m.n_head} divisible by "
                    f"train.cp={cp}: pick another cp or drop ulysses"
                )


main = hydra_main(
    "tp_attention.conf", rank_fn=rank_fn, validate=validate, finalize=finalize, config_name="cp"
)
