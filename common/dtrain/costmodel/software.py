"""Which layouts a training framework can run (``Software``): the space ``search`` looks for the
best in.

The cost of a layout is the same whatever runs it (``Stack`` says how the software moves the
cost); what differs is which layouts exist. A torchtitan user has no ZeRO-1 and no Ulysses,
2021's Megatron had neither sequence parallelism nor selective recompute, and DeepSpeed's
pipeline engine refuses ZeRO-2/3 and interleaving. "the best layout" then means the best one the
user's framework runs (``dtrain plan --software``), and the published layout of a run is compared
with the best its own software could have run (``dtrain backtest``). Each entry names the code it
was read from."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.core.checks import one_of
from dtrain.core.errors import UserError
from dtrain.core.layout import CP_IMPLS, PP_SCHEDULES
from dtrain.parallel.feasibility import OWN_CP_IMPLS, check_cp_layout

from .shapes import pipeline_refusal

__all__ = ["Software", "SOFTWARE", "software", "unsupported"]


@dataclass(frozen=True)
class Software:
    """``zero``: ZeRO stages without PP, ``zero_pp`` with it; ``cp_impls``: context-parallel
    implementations (``Layout.cp_impl``; empty: none) the search tries, ``cp_pinned`` those it
    scores only when asked for; ``sp``: sequence parallelism off / on with TP; ``recompute``: the
    levels it runs; ``interleaved``: more than one model chunk per pipeline rank
    (``Layout.virtual_stages``); ``cp_with_pp``: context and pipeline parallelism together;
    ``hsdp``: FSDP sharded inside replica groups (``Layout.dp_replicate``, scored when asked for,
    never searched); ``zero2_regathers``: its ZeRO-2 is FSDP2 without resharding after forward,
    which reshards after each backward and so gathers the weights again for every micro-batch
    (DeepSpeed's ZeRO-2 keeps them replicated: one gather a step, after the optimizer);
    ``even_split``: when the layers must split into whole, equal pipeline chunks (pp·v divides
    them): "never" (uneven stages run), "interleaved" (only with v > 1), "always";
    ``interleaved_groups``: its interleaved schedule runs the micro-batches in groups of pp
    (Megatron's schedules.py: their count must be a multiple of pp when v > 1); ``kv_shards``:
    its TP shards whole KV heads, so tp must divide them (Megatron's attention.py
    ``divide(num_query_groups, tp)``; torchtitan's views each rank's K, V as whole heads);
    without it (dtrain, "any") a tp above the KV heads replicates them; ``trainer_rules``: its
    pipeline rules are this project's trainer's (``dtrain.parallel.feasibility.check_pipeline``,
    called through ``shapes.pipeline_refusal``: pp·v stage chunks of at least one layer each,
    enough micro-batches for the schedule); ``model_parallel``: it runs TP and PP (the eager FSDP
    stacks shard data only); ``pipeline_engine`` (``pipeline_engine.ENGINES``): whose
    engine runs its pipeline, "megatron" (batched send-and-receive pairs; torchtitan's and dtrain's
    price the same) or "deepspeed" (DeepSpeed's TrainSchedule and blocking transfers, priced by
    ``pipeline_engine``); ``tp_overlaps``: the TP overlaps it runs, "te" (TransformerEngine's
    userbuffers, ``Stack.tp_overlap``) and "async" (torchtitan's AsyncTP, ``Stack.async_tp``);
    ``schedules``: the pipeline schedules it runs (``Layout.pp_schedule``; 1f1b: interleaved when
    v > 1); ``fsdp2``: its ZeRO-2/3 is FSDP2's ``fully_shard``, whose all-gathers are copied out
    parameter by parameter on the compute stream (``eager.fsdp2_copy_out_s``)."""

    name: str
    zero: tuple[int, ...]
    zero_pp: tuple[int, ...]
    cp_impls: tuple[str, ...]
    sp: tuple[bool, ...]
    recompute: tuple[str, ...]
    interleaved: bool
    source: str
    cp_with_pp: bool = True
    hsdp: bool = False
    cp_pinned: tuple[str, ...] = ()
    zero2_regathers: bool = False
    even_split: str = "never"
    interleaved_groups: bool = False
    kv_shards: bool = False
    trainer_rules: bool = False
    model_parallel: bool = True
    pipeline_engine: str = "megatron"
    tp_overlaps: tuple[str, ...] = ()
    schedules: tuple[str, ...] = PP_SCHEDULES
    fsdp2: bool = False

    def zeros(self, pp: int) -> tuple[int, ...]:
        return self.zero_pp if pp > 1 else self.zero

    def splits(self, n_layer: int, pp: int, v: int = 1) -> bool:
        """Whether it splits ``n_layer`` layers over ``pp`` stages of ``v`` chunks each."""
        even = self.even_split == "always" or (self.even_split == "interleaved" and v > 1)
        return not even or n_layer % (pp * v) == 0


def _trainer_allows(check, *args) -> bool:
    """Whether the trainer's ``check`` (a ``dtrain.parallel.feasibility`` rule) passes ``args``:
    the "dtrain" row reads its rules from the trainer rather than restating them."""
    try:
        check(*args)
    except UserError:
        return False
    return True


SOFTWARE = {
    s.name: s
    for s in (
        # "any" searches this project's own CP implementations; PyTorch's (CUDA only) when pinned
        Software(
            "any",
            (0, 1, 2, 3),
            (0, 1, 2, 3),
            OWN_CP_IMPLS,
            (False, True),
            ("none", "op", "selective", "full"),
            True,
            "every layout the cost model prices (PyTorch's context_parallel, 'torch', when asked "
            "for)",
            hsdp=True,
            cp_pinned=("torch",),
            tp_overlaps=("te", "async"),
        ),
        Software(
            "megatron-core",
            (0, 1),
            (0, 1),
            ("ring", "ulysses"),
            (False, True),
            ("none", "selective", "full"),
            True,
            "Megatron-LM core_r0.10: DDP or the distributed optimizer "
            "(--use-distributed-optimizer), --sequence-parallel, --recompute-granularity "
            "selective|full, --num-layers-per-virtual-pipeline-stage, --context-parallel-size "
            "with --cp-comm-type p2p (ring) or a2a (Ulysses); its arguments.py asserts num_layers "
            "% pipeline size == 0 and, interleaved, whole layers per virtual stage (uneven stages "
            "only without interleaving, through --decoder-first/last-pipeline-num-layers); its "
            "interleaved schedule runs the micro-batches in groups of the pipeline size "
            "(pipeline_parallel/schedules.py)",
            even_split="interleaved",
            interleaved_groups=True,
            kv_shards=True,
            tp_overlaps=("te",),
            schedules=("1f1b",),  # pipeline_parallel/schedules.py: 1F1B, interleaved or not
        ),
        Software(
            "megatron-2021",
            (0,),
            (0,),
            (),
            (False,),
            ("none", "full"),
            True,
            "Megatron-LM of SC'21 (Narayanan et al. 2021): DDP, full activation checkpointing, "
            "the interleaved schedule (megatron/model/transformer.py of 2021 asserts num_layers % "
            "pipeline size == 0 and builds --num-layers-per-virtual-pipeline-stage whole layers "
            "per chunk); sequence parallelism, selective recompute and the distributed optimizer "
            "came in 2022; its schedules.py asserts the micro-batches divisible by the pipeline "
            "size when interleaved",
            even_split="always",
            interleaved_groups=True,
            kv_shards=True,
            schedules=("1f1b",),
        ),
        Software(
            "megatron-deepspeed",
            (0, 1, 2, 3),
            (0, 1),
            (),
            (False,),
            ("none", "full"),
            False,
            "DeepSpeed's pipeline engine with Megatron's TP (MT-NLG, BLOOM, GPT-NeoX; "
            "runtime/pipe/engine.py): ZeRO-2/3 refused with PP, TrainSchedule's 1F1B without "
            "interleaving, full checkpointing; blocking p2p transfers (runtime/pipe/p2p.py)",
            kv_shards=True,
            pipeline_engine="deepspeed",
            schedules=("1f1b",),  # TrainSchedule
        ),
        Software(
            "torchtitan",
            (0, 2, 3),
            (0, 3),
            ("torch",),
            (True,),
            ("none", "op", "full"),
            True,
            "torchtitan: DDP or FSDP2 (reshard_after_forward off: ZeRO-2, on: ZeRO-3; under PP "
            "its stages keep their weights gathered and reduce after the last backward, priced as "
            "zero=3), TP always with sequence parallelism, activation checkpointing "
            "none|selective op|full, looped pipeline schedules, PyTorch's context_parallel, HSDP "
            "(data_parallel_replicate_degree)",
            hsdp=True,
            zero2_regathers=True,
            kv_shards=True,
            tp_overlaps=("async",),
            fsdp2=True,
        ),
        Software(
            "dtrain",
            (0, 2, 3),
            (0, 3),
            CP_IMPLS,
            (False, True),
            ("none", "op", "full"),
            True,
            "this project's trainer (costmodel/overrides.py): ddp, zero2, zero3 (no "
            "optimizer-only sharding; under PP FSDP reduces after the last backward, priced as "
            "zero=3), activation_checkpointing none|op|block, cp_impl ring|ulysses|torch, "
            "interleaved 1F1B, hsdp; cp with pp and the pipeline's layers and micro-batches as "
            "dtrain.parallel.feasibility rules them (check_cp_layout, check_pipeline)",
            cp_with_pp=_trainer_allows(check_cp_layout, 2, "ring", 2),
            hsdp=True,
            zero2_regathers=True,
            trainer_rules=True,
            fsdp2=True,
        ),
        Software(
            "fsdp-eager",
            (2, 3),
            (),
            (),
            (False,),
            ("none", "full"),
            False,
            "the eager FSDP stack (Hugging Face Accelerate / Trainer with FSDP, Lightning, "
            "Composer, dtrain's trainer without compile): FSDP FULL_SHARD (ZeRO-3) or "
            "SHARD_GRAD_OP "
            "(ZeRO-2) only, activation checkpointing of whole blocks or none, no TP, PP or CP; "
            "its costs: costmodel/eager.py",
            zero2_regathers=True,
            model_parallel=False,
            fsdp2=True,
        ),
    )
}


def software(name: str) -> Software:
    one_of("software", name, SOFTWARE, error=ValueError)
    return SOFTWARE[name]


def unsupported(
    sw: Software, fields: dict, n_layer: int | None = None, kv_heads: int | None = None
) -> str | None:
    """Why ``sw`` cannot run a layout with these ``Layout`` fields (a whole layout's, or the ones
    ``dtrain plan --layout`` pins) for a model of ``n_layer`` layers and ``kv_heads`` KV heads,
    naming the first field it lacks; None when it runs them ("any" runs every layout)."""
    pp, zero = fields.get("pp"), fields.get("zero_stage")
    zeros = sw.zeros(pp) if pp else tuple(sorted(set(sw.zero) | set(sw.zero_pp)))
    shards = fields.get("dp", 2) * fields.get("cp", 1)
    if zero is not None and shards > 1 and zero not in zeros:
        return (
            f"zero={zero}{' with pp > 1' if pp and pp > 1 else ''} (it runs "
            f"zero={', '.join(map(str, zeros))})"
        )
    if not sw.model_parallel and (fields.get("tp", 1) > 1 or (pp or 1) > 1):
        return "tp > 1 or pp > 1 (it shards data only: FSDP)"
    if fields.get("cp", 1) > 1 and not sw.cp_impls:
        return "cp > 1 (it has no context parallelism)"
    if fields.get("cp", 1) > 1 and (pp or 1) > 1 and not sw.cp_with_pp:
        return "cp > 1 with pp > 1 (it runs one or the other)"
    impl = fields.get("cp_impl")
    if impl is not None and fields.get("cp", 2) > 1 and impl not in sw.cp_impls + sw.cp_pinned:
        return f"cp_impl={impl} (it runs cp_impl={', '.join(sw.cp_impls)})"
    if (
        fields.get("tp", 2) > 1
        and fields.get("sequence_parallel") is not None
        and fields["sequence_parallel"] not in sw.sp
    ):
        return f"sp={'on' if fields['sequence_parallel'] else 'off'} with tp > 1"
    if fields.get("recompute") is not None and fields["recompute"] not in sw.recompute:
        return f"recompute={fields['recompute']} (it runs {', '.join(sw.recompute)})"
    if fields.get("dp_replicate", 1) > 1 and not sw.hsdp:
        return f"hsdp={fields['dp_replicate']} (it has no hybrid sharding)"
    sched = fields.get("pp_schedule")
    if sched is not None and (pp or 2) > 1 and sched not in sw.schedules:
        return f"schedule={sched} (it runs schedule={', '.join(sw.schedules)})"
    if fields.get("virtual_stages", 1) > 1 and not sw.interleaved:
        return f"v={fields['virtual_stages']} (it has no interleaved schedule)"
    tp = fields.get("tp", 1)
    if kv_heads and sw.kv_shards and kv_heads % tp:
        return f"tp={tp} with {kv_heads} KV heads (it shards whole KV heads: tp must divide them)"
    v = fields.get("virtual_stages", 1)
    if sw.trainer_rules and pp and n_layer and n_layer < pp * v:
        return pipeline_refusal(n_layer, pp, "interleaved_1f1b" if v > 1 else "gpipe", v, pp)
    if pp and n_layer and not sw.splits(n_layer, pp, v):
        how = "its interleaved schedule splits" if sw.even_split == "interleaved" else "it splits"
        return (
            f"pp={pp}{f' v={v}' if v > 1 else ''} for {n_layer} layers ({how} the layers into "
            "whole, equal chunks: pp·v must divide them)"
        )
    return None
