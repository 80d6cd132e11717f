"""From `dtrain plan`'s parsed flags to what the plan is of: the global batch
(``global_batch_of``), the software stack (``stack_of``), the model (``shape_from_args``) and the
cluster (``cluster_from_args``: the datasheet units converted once). Bad input is a
``UserError``."""

from __future__ import annotations

from dataclasses import replace

from dtrain.core.errors import UserError

from .hardware import Cluster, get_profile
from .kernel_rates import published
from .software import software
from .stack import Stack
from .eager import SOFTWARE as EAGER_SOFTWARE, STACK_DEFAULTS
from .shapes import ModelShape, params_text


def global_batch_of(a) -> int:
    """Sequences per step: --global-batch when given, else the largest power of two of --seq
    sequences within --global-batch-tokens (at least 1; a power of two splits over the search's
    power-of-two degrees)."""
    if a.global_batch is not None:
        return a.global_batch
    fit = max(1, a.global_batch_tokens // a.seq)
    return 1 << (fit.bit_length() - 1)


def stack_of(a) -> Stack:
    if a.tp_overlap and a.async_tp:
        raise UserError(
            "--tp-overlap (Megatron / TransformerEngine) and --async-tp (torchtitan) are two "
            "stacks: give the one the run used"
        )
    own = STACK_DEFAULTS if a.software == EAGER_SOFTWARE else {}
    for flag, kind in (("tp_overlap", "te"), ("async_tp", "async")):
        if getattr(a, flag) and kind not in software(a.software).tp_overlaps:
            raise UserError(
                f"--{flag.replace('_', '-')}: --software {a.software} does not run it: drop it, "
                f"or pass --software {'megatron-core' if kind == 'te' else 'torchtitan'} or any"
            )
    return Stack(
        a.attention or own.get("attention", "flash"),
        a.kernels or own.get("kernels", "fused"),
        a.loss or own.get("loss"),
        a.tp_overlap,
        a.async_tp,
        a.fp8_all_gather,
        a.grad_reduce,
        a.optimizer_states,
        a.dp_sync,
        a.software,
        a.fp8_scaling,
        a.optimizer or own.get("optimizer"),
    )


def shape_from_args(a) -> ModelShape:
    shape_flags = (a.layers, a.hidden, a.heads)
    if a.params is not None and any(x is not None for x in shape_flags):
        raise UserError("give either --params or the shape (--layers --hidden --heads), not both")
    if a.params is not None:
        if a.params <= 0:
            raise UserError(f"--params {a.params:g} must be positive, e.g. --params 70e9")
        check_params(a.params)
        return replace(
            ModelShape.from_params(a.params, seq_len=a.seq), dropout=a.dropout, rotary=not a.no_rope
        )
    if any(x is None for x in shape_flags):
        raise UserError("the model needs --params, or all of --layers, --hidden and --heads")
    check_heads(a.hidden, a.heads, a.kv_heads)
    ffn = a.ffn_hidden or (int(8 * a.hidden / 3) if a.gated_mlp else 4 * a.hidden)
    try:
        return ModelShape(
            a.layers,
            a.hidden,
            a.heads,
            a.kv_heads or a.heads,
            a.vocab,
            a.seq,
            ffn / a.hidden,
            a.gated_mlp,
            name=f"{a.layers} x {a.hidden}",
            dropout=a.dropout,
            rotary=not a.no_rope,
        )
    except ValueError as e:
        raise UserError(f"bad model shape: {e}") from None


def check_params(params: float) -> None:
    """--params below the smallest model ``ModelShape.from_params`` builds would be planned as that
    bigger model under the asked-for name: refused, with the minimum."""
    low = ModelShape.smallest_from_params()
    least = params_text(low.num_params())
    if params < low.num_params():
        raise UserError(
            f"--params {params_text(params)} is below {least}, the smallest model --params builds "
            f"({low.n_layer} layer x {low.d_model}, {low.n_head} heads, a {low.vocab}-token "
            f"vocabulary): give --params {least} or more, or the shape (--layers --hidden --heads)"
        )


def check_heads(hidden: int, heads: int, kv_heads: int | None) -> None:
    """The attention heads a shape can have, named by the flags that give them."""
    if hidden % heads:
        raise UserError(
            f"--hidden {hidden} is not divisible by --heads {heads} (head dim must be "
            "a whole number): pick heads that divide hidden"
        )
    if kv_heads is not None and heads % kv_heads:
        raise UserError(
            f"--heads {heads} is not divisible by --kv-heads {kv_heads} (each k/v head "
            "serves a whole group of query heads): pick kv-heads that divide heads"
        )


def cluster_from_args(a) -> Cluster:
    for flag, value in (
        ("--gpus", a.gpus),
        ("--gpus-per-node", a.gpus_per_node),
        ("--nvlink-gbps", a.nvlink_gbps),
        ("--ib-gbps", a.ib_gbps),
        ("--global-batch", a.global_batch),
        ("--seq", a.seq),
    ):
        if value is not None and value <= 0:
            raise UserError(f"{flag} {value:g} must be positive")
    if a.gpus > a.gpus_per_node and a.gpus % a.gpus_per_node:
        raise UserError(
            f"--gpus {a.gpus} is not a whole number of {a.gpus_per_node}-GPU nodes: "
            "pass a multiple of --gpus-per-node"
        )
    if not 0 <= a.headroom < 1:
        raise UserError(f"--headroom {a.headroom} must be in [0, 1)")
    if a.power_w is not None:
        table = published(a.gpu)
        idle = table.idle_w if table else 0.0
        if a.power_w <= idle:
            raise UserError(
                f"--power-w {a.power_w:g} is at or below {a.gpu}'s idle draw ({idle:g} W): "
                "give the board's power limit in W"
            )
    per_dir = (
        None if a.nvlink_gbps is None else a.nvlink_gbps / 2
    )  # datasheet bidirectional -> per direction
    variant = {
        k: v
        for k, v in (("hbm_gib", a.hbm_gib), ("hbm_tbps", a.hbm_tbps), ("power_w", a.power_w))
        if v is not None
    }
    gpu = replace(get_profile(a.gpu), **variant) if variant else a.gpu
    return Cluster.from_profile(
        gpu, a.gpus, a.gpus_per_node, ib_gbit_per_gpu=a.ib_gbps, nvlink_gbps_per_dir=per_dir
    )
