"""`dtrain plan`: the best DP×TP×PP layout for one model on one cluster, and why.

    dtrain plan --params 70e9 --gpus 512 --gpus-per-node 8 --nvlink-gbps 900 --ib-gbps 400
    dtrain plan --params 405e9 --gpus 2048 --layout "tp=8 pp=16 v=8 zero=1 recompute=selective mb=1"

``--layout`` scores a layout you already run: the fields given are fixed, the rest searched, and
the answer says how far it is from the unconstrained best.

Units are the ones printed on datasheets, converted here once:
  --nvlink-gbps  GB/s (bytes) per GPU, BOTH directions added (H100 SXM: 900, A100: 600); the model
                 uses half of it, the per-direction rate that nccl-tests' bus bandwidth approaches.
  --ib-gbps      Gbit/s (bits) per GPU, the NIC line rate (NDR 400, HDR 200); ÷8 gives GB/s.
Exit codes: 0 a plan was found, 1 nothing fits in memory, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from dtrain.core import terminal
from dtrain.core.checks import one_of
from dtrain.core.errors import UserError

from .hardware import Cluster, get_profile, load_profiles
from .compute import EAGER_BYTES, published
from .software import SOFTWARE, software, unsupported
from .stack import ATTENTION_KERNELS, DP_SYNCS, FP8_ALL_GATHERS, FP8_SCALINGS, STATE_DTYPES, Stack
from .stack import OPTIMIZERS
from .eager import SOFTWARE as EAGER_SOFTWARE, STACK_DEFAULTS
from .shapes import (
    CP_IMPLS,
    PP_SCHEDULES,
    PP_SPLITS,
    RECOMPUTE,
    ModelShape,
    parallel_refusal,
    params_text,
)
from .plan_report import (
    calibration_notes,
    framework_gap,
    fit_lines,
    framework_text,
    layout_json,
    layout_text,
    Runnable,
    plan_dict,
    res_usable,
    runnable_text,
    text_report,
    to_json,
)
from .search import SearchResult, search
from .explain_tp import explain_tp, explain_tp_json
from . import moe_cli

GLOBAL_BATCH_TOKENS = 1024 * 4096  # the default batch: 1,024 sequences at --seq 4096


def global_batch_of(a) -> int:
    """Sequences per step: --global-batch when given, else the largest power of two of --seq
    sequences within --global-batch-tokens (at least 1; a power of two splits over the search's
    power-of-two degrees)."""
    if a.global_batch is not None:
        return a.global_batch
    fit = max(1, a.global_batch_tokens // a.seq)
    return 1 << (fit.bit_length() - 1)


EPILOG = """units: --nvlink-gbps is GB/s per GPU with both directions added (the datasheet's "NVLink
900 GB/s" for H100 SXM; 600 for A100; a PCIe Gen5 x16 node without NVLink is 128); the cost model
uses half of it per direction. --ib-gbps is Gbit/s per GPU, the NIC line rate (InfiniBand NDR 400,
HDR 200); 400 Gbit/s = 50 GB/s. --global-batch counts sequences of --seq tokens; without it the
batch is --global-batch-tokens (4,194,304) in sequences.
exit codes: 0 plan found, 1 does not fit in memory, 2 bad input."""


def _number(kind, low: float, strict: bool):
    """An argparse type: a finite number above `low` (`--params nan`, `--seq 0` are one error
    line)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(
                f"{text} must be {what} {'>' if strict else '>='} {low:g}"
            )
        return value

    parse.__name__ = f"{kind.__name__}{' > ' if strict else ' >= '}{low:g}"
    return parse


POS_INT, POS_FLOAT, NONNEG_INT, NONNEG_FLOAT = (
    _number(int, 0, True),
    _number(float, 0, True),
    _number(int, 0, False),
    _number(float, 0, False),
)
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def param_count(text: str) -> float:
    """--params: a positive number, plain (70e9) or with the suffix people write sizes in (70B,
    1.3b, 350M, 1T)."""
    number, unit = (
        (text[:-1], _SUFFIX.get(text[-1].lower())) if text[-1:].isalpha() else (text, 1.0)
    )
    try:
        value = float(number) * unit
    except (ValueError, TypeError):  # not a number, or an unknown suffix (unit None)
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive parameter count (70e9, 70B, 350M, 1T)"
        )
    return value


param_count.__name__ = "parameter count"


def add_parser(sub) -> None:
    gpus = sorted(load_profiles())
    p = sub.add_parser(
        "plan",
        help="choose DP x TP x PP, ZeRO stage, recompute and micro-batch for a model",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model (either --params or --layers/--hidden/--heads)")
    m.add_argument(
        "--params",
        type=param_count,
        help="parameter count, e.g. 70e9 or 70B (a published shape of that size)",
    )
    m.add_argument("--layers", type=POS_INT, help="transformer layers")
    m.add_argument("--hidden", type=POS_INT, help="d_model")
    m.add_argument("--heads", type=POS_INT, help="attention heads")
    m.add_argument(
        "--kv-heads", type=POS_INT, help="KV heads (grouped-query attention; default = --heads)"
    )
    m.add_argument(
        "--ffn-hidden",
        type=POS_INT,
        help="MLP hidden size (default 4 x hidden, or 8/3 x with --gated-mlp)",
    )
    m.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP (3 matrices), as in Llama")
    m.add_argument("--vocab", type=POS_INT, default=32000, help="vocabulary size (default 32000)")
    m.add_argument(
        "--seq", type=POS_INT, default=4096, help="sequence length in tokens (default 4096)"
    )
    m.add_argument(
        "--dropout",
        action="store_true",
        help="GPT-3-style dropout (attention probabilities and residuals): masks stored, passes "
        "priced",
    )
    m.add_argument(
        "--no-rope",
        action="store_true",
        help="no rotary embeddings (learned or ALiBi positions, as GPT-3, BLOOM): no RoPE pass "
        "priced",
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=POS_INT, required=True, help="GPUs in the job")
    c.add_argument("--gpus-per-node", type=POS_INT, default=8, help="GPUs per node (default 8)")
    c.add_argument("--gpu", default="h100-sxm", choices=gpus, help="GPU type (default h100-sxm)")
    c.add_argument(
        "--nvlink-gbps",
        type=POS_FLOAT,
        help="intra-node GB/s per GPU, both directions added "
        "(default: the GPU's datasheet NVLink figure)",
    )
    c.add_argument(
        "--ib-gbps",
        type=POS_FLOAT,
        help="inter-node Gbit/s per GPU, NIC line rate (default: the GPU's reference system)",
    )
    c.add_argument(
        "--hbm-gib",
        type=POS_FLOAT,
        help="HBM per GPU in GiB, for a variant of --gpu (e.g. 96 for "
        "the 96 GB H100 SXM; default: the profile's)",
    )
    c.add_argument(
        "--hbm-tbps", type=POS_FLOAT, help="HBM bandwidth in TB/s, for a variant of --gpu"
    )
    c.add_argument(
        "--power-w",
        type=POS_FLOAT,
        help="board power cap in W, for a variant of --gpu (a lower cap "
        "slows tensor-core work as ((profile - idle)/(cap - idle))^(1/3), kernels.yaml)",
    )
    r = p.add_argument_group("training")
    r.add_argument(
        "--global-batch",
        type=POS_INT,
        default=None,
        help="sequences per optimizer step (default: from --global-batch-tokens; given, it wins)",
    )
    r.add_argument(
        "--global-batch-tokens",
        type=POS_INT,
        default=GLOBAL_BATCH_TOKENS,
        help=f"tokens per optimizer step (default {GLOBAL_BATCH_TOKENS:,} = 1,024 x 4,096): the "
        "most sequences of --seq tokens within it, a power of two, at least 1",
    )
    r.add_argument(
        "--precision",
        choices=("bf16", "fp8", "mxfp8"),
        default="bf16",
        help="compute precision (default bf16); mxfp8: Blackwell's block-scaled FP8, priced at "
        "the FP8 rate; fp8 and mxfp8 also dispatch MoE tokens in FP8",
    )
    r.add_argument(
        "--headroom", type=NONNEG_FLOAT, default=0.1, help="share of HBM kept free (default 0.1)"
    )
    r.add_argument(
        "--attention",
        choices=ATTENTION_KERNELS,
        default=None,
        help="flash (default; flash2 with --software fsdp-eager): the GPU's best fused attention "
        "(FlashAttention-2 on A100; cuDNN / FlashAttention-3 class on H100, PyTorch SDPA's "
        "default there); flash2: FlashAttention-2 "
        "(PyTorch's flash backend, flash-attn 2) on any GPU; eager: scores stored (5*a*s/h per "
        "layer) and the softmax run over them, selective recompute then pays",
    )
    r.add_argument(
        "--kernels",
        choices=("fused", "eager"),
        default=None,
        help="fused (default; eager with --software fsdp-eager): fused norm/activation/cast "
        "kernels (Megatron, torch.compile); eager: PyTorch without compile, %gx the memory-bound "
        "bytes" % EAGER_BYTES,
    )
    r.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="the AdamW: foreach (PyTorch's default) or fused (fused=True); default: as --kernels "
        "(foreach with --software fsdp-eager)",
    )
    r.add_argument(
        "--loss",
        choices=("fused", "eager"),
        default=None,
        help="the cross-entropy: fused (vocab-parallel, in place on fp32 logits, 4 B/logit) or "
        "eager (PyTorch's F.cross_entropy, 14 B/logit; torchtitan compiles its blocks but not "
        "its loss); default: as --kernels",
    )
    r.add_argument(
        "--tp-overlap",
        action="store_true",
        help="TP collectives overlapped with the GEMMs (Megatron --tp-comm-overlap, "
        "TransformerEngine)",
    )
    r.add_argument(
        "--async-tp",
        action="store_true",
        help="torchtitan's AsyncTP: hides the share of TP traffic its published with/without pairs "
        "show",
    )
    r.add_argument(
        "--fp8-all-gather",
        choices=FP8_ALL_GATHERS,
        default="tp",
        help="with --precision fp8, which all-gathers move FP8: tp (default; the sequence-parallel "
        "gathers, as TransformerEngine and torchao's Float8 TP do), tp+fsdp (also FSDP/ZeRO weight "
        "gathers: torchao enable_fsdp_float8_all_gather, Megatron --fp8-param-gather), none",
    )
    r.add_argument(
        "--fp8-scaling",
        choices=FP8_SCALINGS,
        default=None,
        help="with --precision fp8, how the casts are scaled, which sets their cost: dynamic "
        "(torchao's float8 training: a global amax per tensor before its cast), eager (the "
        "same without compile, op by op) or delayed "
        "(TransformerEngine: amax history, casts fused into the producing kernels); default: "
        "the --software's own (dynamic for torchtitan and dtrain, eager for fsdp-eager, else "
        "delayed)",
    )
    r.add_argument(
        "--grad-reduce",
        choices=STATE_DTYPES,
        default="fp32",
        help="the dtype gradients accumulate and reduce in over DP: fp32 (default; Megatron's for "
        "bf16, torchtitan's) or bf16 (apex DistributedFusedAdam grad_sync_dtype, torchtitan "
        "mixed_precision_reduce=bfloat16): half the gradient bytes and traffic",
    )
    r.add_argument(
        "--optimizer-states",
        choices=STATE_DTYPES,
        default="fp32",
        help="fp32 (default): fp32 master weights and Adam moments, 12 B/param; bf16: Adam moments "
        "in bf16 and no master copy (apex DistributedFusedAdam dtype=bf16, as NeMo runs it), "
        "4 B/param",
    )
    r.add_argument(
        "--dp-sync",
        choices=DP_SYNCS,
        default="overlap",
        help="when the once-per-step DP collectives run: overlap (default; Megatron's "
        "--overlap-grad-reduce and --overlap-param-gather: behind the last backward and the "
        "first forward) or flush (DeepSpeed's pipeline engine: after the pipeline's last "
        "step, nothing hidden)",
    )
    r.add_argument(
        "--software",
        choices=tuple(SOFTWARE),
        default="any",
        help="the framework the run uses: the best layout is the best one it runs (any, default: "
        "every layout; megatron-core; megatron-2021: no SP, selective recompute or "
        "distributed optimizer; megatron-deepspeed: DeepSpeed's pipeline engine, no "
        "interleaving, ZeRO-0/1 with PP; torchtitan: DDP or FSDP, SP with TP, PyTorch's "
        "context_parallel; dtrain: this project's trainer, whose overrides the plan prints; "
        "fsdp-eager: FSDP without compile (Accelerate, Lightning, Composer), ZeRO-2/3 only, "
        "its kernel launches and dispatch floor priced, costmodel/eager.py); "
        "costmodel/software.py",
    )
    p.add_argument(
        "--layout",
        metavar="FIELDS",
        help='score a layout: any of "dp= cp= cp_impl=ring|ulysses|torch tp= pp= v= '
        "schedule=1f1b|gpipe|zbv split=layers|balanced "
        'zero= hsdp= recompute=none|op|selective|full mb= sp=on|off"; '
        "given fields are fixed, the rest searched; hsdp=R: FSDP sharded inside R replica groups; "
        "split=balanced: the embedding and the loss take one layer's slot each in the pipeline "
        "split "
        "(Megatron's --account-for-embedding/loss-in-pipeline-split)",
    )
    p.add_argument(
        "--results",
        metavar="DIR",
        action="append",
        help="calibrate from run dirs under DIR (only CUDA runs describe a GPU cluster)",
    )
    p.add_argument("--top", type=NONNEG_INT, default=5, help="runners-up to explain (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--explain-tp",
        action="store_true",
        help="also print the best plan against the best plan at TP 8, term by term (compute, TP "
        "traffic exposed and hidden, the overlap's SM cost, DP/ZeRO, bubble, memory)",
    )
    moe_cli.add_arguments(p, POS_INT, NONNEG_INT, POS_FLOAT)
    p.set_defaults(func=run)


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


def check_batch_splits(result: SearchResult) -> None:
    """A global batch that no layout's data-parallel replicas can share (each needs whole
    sequences) is bad input, not a cluster too small: more GPUs only add replicas. Names the least
    dp a layout has."""
    rejected = result.rejected_with_reasons
    if result.best is not None or not rejected:
        return
    if not all(isinstance(why, str) and why.startswith("global batch") for _, why in rejected):
        return  # something was rejected for memory: the report says what does not fit
    batch, gpus = result.global_batch, result.cluster.gpus
    least = min(lay.dp for lay, _ in rejected)
    replicas = f"replica{'s' * (batch > 1)}"
    fits = (
        f"a global batch of {batch} feeds at most {batch} data-parallel {replicas}"
        if batch < least
        else f"{batch} is not a multiple of any of their dp"
    )
    raise UserError(
        f"--global-batch {batch} cannot be split over {gpus} GPUs: every layout of this model has "
        f"at least dp={least} data-parallel replicas (tp, cp and pp are bounded by its heads, "
        f"sequence and layers) and {fits}: give a --global-batch that is a multiple of {least}, "
        "or fewer --gpus"
    )


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


def runnable(result: SearchResult, a, calib, cluster) -> Runnable:
    """Whether the trainer runs the choice's overrides as printed (its own checks:
    ``overrides.trainer_refusal``); when not, the search again restricted to ``--software
    dtrain``, whose best it runs."""
    from .overrides import train_overrides, trainer_refusal

    if result.best is None:
        return Runnable()
    overrides, _ = train_overrides(result.best, result.model, result.global_batch, a.precision)
    why = trainer_refusal(overrides)
    if why is None:
        return Runnable()
    alt = search(
        result.model,
        cluster,
        result.global_batch,
        calib,
        precision=a.precision,
        headroom=a.headroom,
        # the trainer runs neither TE's overlap nor AsyncTP
        stack=replace(stack_of(a), software="dtrain", tp_overlap=False, async_tp=False),
    )
    return Runnable(why, alt)


def run(a) -> int:
    from .links import default_links

    a.global_batch = global_batch_of(a)
    shape, datasheet = shape_from_args(a), cluster_from_args(a)
    moe_cli.check_precision(a.precision, datasheet.gpu.name)
    if a.experts is None:
        moe_cli.refuse_moe_flags(a)
        a.precision = "fp8" if a.precision == "mxfp8" else a.precision  # priced as FP8
    if a.precision == "fp8" and datasheet.gpu.fp8_tflops is None:
        raise UserError(f"{datasheet.gpu.name} has no FP8 tensor cores: use --precision bf16")
    notes = ["calibration: datasheet/published values (pass --results DIR to use measured ones)"]
    calib = None
    cluster = default_links().apply(datasheet)
    if a.results:
        from .calibrate import (
            calibrate_naming_skips,
        )  # reads run directories: pandas, only when asked

        report, skipped = calibrate_naming_skips(a.results, gpu=datasheet.gpu.name)
        for message in skipped:
            print(f"warning: {message}", file=sys.stderr)
        calib, cluster = report.cluster, report.cluster_links.apply(datasheet)
        notes = calibration_notes(report) + [f"  skipped: {m}" for m in skipped]
    stack, fixed = stack_of(a), pinned_layout(a, datasheet.gpus, shape)
    if a.experts is not None:
        return moe_cli.run(a, shape, cluster, calib, stack, fixed)
    result = search(
        shape,
        cluster,
        a.global_batch,
        calib,
        precision=a.precision,
        headroom=a.headroom,
        stack=stack,
    )
    check_batch_splits(result)
    run_it = runnable(result, a, calib, cluster)
    mine, gap, tight = layout_result(shape, cluster, a, calib, result, fixed)
    free = (
        None
        if stack.software == "any"
        else search(
            shape,
            cluster,
            a.global_batch,
            calib,
            precision=a.precision,
            headroom=a.headroom,
            stack=replace(stack, software="any"),
        )
    )
    if a.json:
        out = to_json(result, a.top, notes, run_it)
        if free is not None:
            out["any_framework"] = {
                "choice": plan_dict(free.best, free) if free.best else None,
                "faster_pct": framework_gap(result, free),
            }
        if mine is not None:
            out["layout"] = layout_json(mine, gap, a.layout, tight)
        if a.explain_tp:
            out["explain_tp"] = explain_tp_json(result)
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        lines = text_report(result, a.top, notes, runnable_text(result, run_it))
        if free is not None:
            lines += [""] + framework_text(result, free)
        if mine is not None:
            lines += [""] + layout_text(mine, gap, a.layout, res_usable(mine), tight)
        if a.explain_tp:
            lines += [""] + explain_tp(result)[0]
        print("\n".join(fit_lines(lines, terminal.width())))
    if mine is not None and mine.best is None:
        print(
            f'error: your layout "{a.layout}" cannot run: {mine.reason}: change --layout (the '
            "report above "
            "shows the best layout)",
            file=sys.stderr,
        )
        return 2
    if result.best is None:
        if not a.json:
            print(
                "hint: more GPUs, a GPU with more memory (--gpu), or a shorter --seq",
                file=sys.stderr,
            )
        return 1
    return 0
