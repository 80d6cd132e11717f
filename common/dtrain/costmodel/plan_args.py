"""The flags of `dtrain plan` (``add_arguments``): the model, the cluster, the training stack,
``--layout`` and the MoE flags (``moe_cli.add_arguments``), with the argparse types that read their
numbers (``POS_INT``, ``param_count``, ...) and the units the help states (``EPILOG``)."""

from __future__ import annotations

import argparse
import math

from .hardware import load_profiles
from .memory_bound import EAGER_BYTES
from .software import SOFTWARE
from .stack import ATTENTION_KERNELS, DP_SYNCS, FP8_ALL_GATHERS, FP8_SCALINGS, STATE_DTYPES
from .stack import OPTIMIZERS
from . import moe_cli

GLOBAL_BATCH_TOKENS = 1024 * 4096  # the default batch: 1,024 sequences at --seq 4096


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


def add_arguments(p) -> None:
    """Adds every `dtrain plan` flag to the parser ``p``, in the order --help lists them."""
    gpus = sorted(load_profiles())
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
