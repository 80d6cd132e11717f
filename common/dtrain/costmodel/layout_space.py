"""The layout space `dtrain plan` searches: named axes (``AXES``) kept by named rules (``FILTERS``).

The layouts have dp·cp·tp·pp = GPUs, a product of named axes (``AXES``: an axis' values may depend
on the ones chosen before it) kept by named rules (``FILTERS``: the trainer's, the software's, the
batch's), each checked as soon as the axes it reads are chosen (``layout_enumeration`` walks them):
  * tp a power of two dividing the heads, at most two nodes wide;
  * pp ≤ layers, the busiest stage holding ceil(L/pp) (uneven stages, as Megatron's
    ``--decoder-first/last-pipeline-num-layers`` allow); interleaving v ∈ {1, 2, 4, 8} when
    v ≤ ceil(L/pp) (Llama 3 405B: 126 layers on 16×8 chunks, two of them without a layer) and
    there are at least pp micro-batches;
  * ZeRO 0–3, also with PP (torchtitan's FSDP + PP allows it, DeepSpeed refuses ZeRO-2/3 with
    PP); the model charges their per-micro-batch traffic;
  * recompute none / op (torchtitan's selective op AC) / selective / full; selective is left out
    under fused (flash) attention, which already drops the stored attention scores at no extra cost
    (``attention="eager"``: the scores are stored and selective recompute pays);
  * micro-batch sizes dividing global_batch / dp; sequence parallelism on/off when tp > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .software import Software
from .shapes import Layout, ModelShape, parallel_refusal, pipeline_refusal, run_schedule

VIRTUAL_STAGES = (1, 2, 4, 8)
LAYOUT_FIELDS = (
    "dp",
    "tp",
    "pp",
    "virtual_stages",
    "zero_stage",
    "recompute",
    "micro_batch",
    "sequence_parallel",
    "pp_schedule",
    "cp",
    "cp_impl",
    "dp_replicate",
    "pp_split",
)
# The shortest sequence chunk a context-parallel rank computes on (half its share: the load-balanced
# split gives it two): fused attention reaches about half its long-sequence rate at ~1K tokens
# (kernels.yaml's s_half) and ~60% at 2K, so the search does not split sequences finer (at 4K
# tokens: no CP)
MIN_CP_CHUNK = 2048


def _pow2_up_to(limit: int) -> list[int]:
    out, t = [], 1
    while t <= limit:
        out.append(t)
        t *= 2
    return out


def context_parallel_degrees(model: ModelShape, limit: int) -> list[int]:
    """cp degrees a sequence can be split over: powers of two with 2·cp chunks of at least
    MIN_CP_CHUNK tokens (the ring's load-balanced causal split gives each rank chunks r and
    2cp−1−r)."""
    return [1] + [
        c
        for c in _pow2_up_to(limit)[1:]
        if not parallel_refusal(model, 1, c) and model.seq_len // (2 * c) >= MIN_CP_CHUNK
    ]


@dataclass(frozen=True, eq=False)
class Space:
    """What one enumeration searches: the model, ``n`` GPUs of ``node_size`` per node, the batch,
    the micro-batches and recompute levels to try, ``fixed`` (the fields ``dtrain plan --layout``
    pins) and ``runs`` (what the software runs). ``memo`` keeps what an enumeration asks again and
    again (the trainer's ``refusal``, the SP settings) once per the degrees it depends on."""

    model: ModelShape
    n: int
    node_size: int
    global_batch: int
    micro_batches: tuple
    recompute: tuple
    prune: bool
    fixed: dict
    context_parallel: bool
    runs: Software
    replicas: int
    memo: dict = field(default_factory=dict)

    def refusal(
        self, tp: int = 1, cp: int = 1, cp_impl: str = "ring", sp: bool = False
    ) -> str | None:
        key = (tp, cp, cp_impl, sp)
        if key not in self.memo:  # the module's parallel_refusal, looked up now (tests patch it)
            self.memo[key] = parallel_refusal(self.model, tp, cp, cp_impl, sp)
        return self.memo[key]


@dataclass(frozen=True)
class Axis:
    """One field of the layouts searched; ``values(space, chosen)`` lists its values given the
    fields chosen before it (``chosen``: axis name -> value), in the order the search tries them."""

    name: str
    values: Callable[[Space, dict], Iterable]


@dataclass(frozen=True)
class Filter:
    """A rule every layout passes, checked as soon as the axis ``after`` has a value, so a rule on
    the degrees prunes before the micro-batches, schedules and ZeRO stages under them are expanded.
    ``ok(space, chosen)`` is the rule; a choice that fails it is dropped, or, with ``rejects``,
    kept as a rejection with the reason ``rejects(space, chosen)`` (the CLI explains those)."""

    name: str
    after: str
    ok: Callable[[Space, dict], bool]
    rejects: Callable[[Space, dict], tuple[Layout, str]] | None = None


def _tp_degrees(s: Space, c: dict):
    """Powers of two up to the heads, at most two nodes wide."""
    if "tp" in s.fixed:
        return (s.fixed["tp"],)
    return _pow2_up_to(min(2 * s.node_size, s.model.n_head))


def _cp_degrees(s: Space, c: dict):
    """Powers of two leaving 2·cp chunks of at least MIN_CP_CHUNK tokens (a pinned cp as given)."""
    if "cp" in s.fixed:
        return (s.fixed["cp"],)
    return context_parallel_degrees(s.model, s.n // c["tp"]) if s.context_parallel else (1,)


def _pp_degrees(s: Space, c: dict):
    """Divisors of the GPUs tp·cp leave, at most the layers (uneven stages allowed)."""
    rest = s.n // (c["tp"] * c["cp"])
    return [p for p in range(1, min(s.model.n_layer, rest) + 1) if rest % p == 0]


def _virtual_stages(s: Space, c: dict):
    if "virtual_stages" in s.fixed:
        return (s.fixed["virtual_stages"],)
    return VIRTUAL_STAGES if s.runs.interleaved else (1,)


def _cp_impls(s: Space, c: dict):
    """The software's CP implementations; those it runs only when asked for, when one is pinned."""
    if c["cp"] == 1:
        return ("ring",)
    return s.runs.cp_impls + (s.runs.cp_pinned if "cp_impl" in s.fixed else ())


def _zero_stages(s: Space, c: dict):
    """The software's ZeRO stages (0 alone without data shards); pruned: from 1 up if it has any."""
    zeros = s.runs.zeros(c["pp"]) if c["dp"] * c["cp"] > 1 else (0,)
    return tuple(z for z in zeros if z >= 1) or zeros if s.prune else zeros


def _sp_settings(s: Space, c: dict):
    """SP off / on where the software runs it and tp > 1; on needs the trainer to split a cp rank's
    tokens over tp; pruned: on only (same time, less memory), where it is possible."""
    tp, cp, impl = c["tp"], c["cp"], c["cp_impl"]
    if tp == 1:
        return (False,)
    key = ("sp", tp, cp, impl)  # asked per (zero stage, recompute), then once per layout
    if key not in s.memo:
        sps = tuple(sp for sp in s.runs.sp if not sp or not s.refusal(tp, cp, impl, True))
        s.memo[key] = (True,) if s.prune and True in sps else sps
    return s.memo[key]


def _pp_split(s: Space, c: dict):
    """A pinned split when pp > 1 (scored when asked for, never searched), else "layers"."""
    return (s.fixed.get("pp_split", "layers") if c["pp"] > 1 else "layers",)


def _batch_rejection(s: Space, c: dict) -> tuple[Layout, str]:
    dp, mb = c["dp"], c["micro_batch"]
    return Layout(dp_shard=dp, tp=c["tp"], pp=c["pp"], micro_batch=mb), (
        f"global batch {s.global_batch} is not a multiple of dp·micro_batch = {dp * mb}"
    )


def _interleaving_fits(s: Space, c: dict) -> bool:
    """v chunks per stage: pp > 1, at most ceil(L/pp) chunks, at least pp micro-batches."""
    v, pp = c["virtual_stages"], c["pp"]
    return v == 1 or (pp > 1 and v <= -(-s.model.n_layer // pp) and c["grad_accum"] >= pp)


def _interleaving_runs(s: Space, c: dict) -> bool:
    """The software splits the layers into pp·v chunks (and micro-batches in groups of pp)."""
    v, pp = c["virtual_stages"], c["pp"]
    return v == 1 or (
        s.runs.splits(s.model.n_layer, pp, v)
        and (c["grad_accum"] % pp == 0 or not s.runs.interleaved_groups)
    )


def _pipeline_runs(s: Space, c: dict) -> bool:
    """A software with the trainer's rules (dtrain) pipelines these stages as its
    ``dtrain.parallel.feasibility.check_pipeline`` allows, with the schedule the overrides run."""
    pp, v, accum = c["pp"], c["virtual_stages"], c["grad_accum"]
    if not s.runs.trainer_rules or pp == 1:
        return True
    lay = Layout(pp=pp, pp_virtual=v, pp_schedule=c["pp_schedule"], grad_accum=accum)
    return not pipeline_refusal(s.model.n_layer, pp, run_schedule(lay), v, accum)


def _schedules(pp: int, v: int, fixed: dict) -> tuple[str, ...]:
    """Pipeline schedules for pp stages of v chunks: 1F1B (interleaved when v > 1), the schedule
    Megatron, DeepSpeed and torchtitan run by default. Zero-bubble V (v = 2) and GPipe (never faster
    than 1F1B, and it holds every micro-batch) are scored when asked for (``fixed["pp_schedule"]``,
    ``dtrain plan --layout schedule=zbv``): ZB-V needs a runtime that splits weight-gradient work
    (torch.distributed.pipelining's ScheduleZBVZeroBubble, dtrain's train.pp_schedule=zbv), so the
    search does not assume one."""
    if "pp_schedule" in fixed:
        want = fixed["pp_schedule"]
        runs = pp > 1 and (want != "zbv" or v == 2) and (want != "gpipe" or v == 1) or pp == 1
        return (want,) if runs else ()
    return ("1f1b",)


# The layouts searched, outermost first: their order is the order the layouts are tried in (ties in
# the ranking keep it). A value may depend on those chosen before it. Names are LAYOUT_FIELDS'
# (``fixed`` pins them) and grad_accum. A field with one value (dp, grad_accum, dp_replicate,
# pp_split) costs one step per layout above it, so it comes as early as what it reads allows;
# dp_replicate and pp_split (scored when asked for, never searched) after micro_batch, so that a
# pinned value a layout lacks drops layouts, not the batch-shape rejections of the degrees.
# A new dimension (ep) is one Axis here, its rules in FILTERS and its field in
# layout_enumeration._layout.
AXES = (
    Axis("tp", _tp_degrees),
    Axis("cp", _cp_degrees),
    Axis("pp", _pp_degrees),
    Axis("dp", lambda s, c: (s.n // (c["tp"] * c["cp"] * c["pp"]),)),  # the rest
    Axis("micro_batch", lambda s, c: s.micro_batches),
    Axis("grad_accum", lambda s, c: (s.global_batch // (c["dp"] * c["micro_batch"]),)),
    Axis("dp_replicate", lambda s, c: (s.replicas,)),
    Axis("pp_split", _pp_split),
    Axis("virtual_stages", _virtual_stages),
    Axis("pp_schedule", lambda s, c: _schedules(c["pp"], c["virtual_stages"], s.fixed)),
    Axis("cp_impl", _cp_impls),
    Axis("zero_stage", _zero_stages),
    Axis("recompute", lambda s, c: s.recompute),
    Axis("sequence_parallel", _sp_settings),
)

# The rules, each checked right after the last axis it reads (before a value pinned by ``fixed`` is
# compared, which every axis does): the trainer's (``shapes.parallel_refusal``), the software's
# (``software.py``) and the batch's.
FILTERS = (
    Filter("tp divides the GPUs", "tp", lambda s, c: s.n % c["tp"] == 0),
    Filter("the software runs tp", "tp", lambda s, c: s.runs.model_parallel or c["tp"] == 1),
    Filter("the software runs pp", "pp", lambda s, c: s.runs.model_parallel or c["pp"] == 1),
    Filter(
        "the software shards whole KV heads over tp",
        "tp",
        lambda s, c: not (s.runs.kv_shards and s.model.n_kv_head % c["tp"]),
    ),
    Filter(
        "the trainer splits the heads and the MLP over tp",
        "tp",
        lambda s, c: not s.refusal(c["tp"]),
    ),
    Filter("cp divides the GPUs tp leaves", "cp", lambda s, c: (s.n // c["tp"]) % c["cp"] == 0),
    Filter(
        "the trainer splits the sequence into 2·cp chunks",
        "cp",
        lambda s, c: not s.refusal(1, c["cp"]),
    ),
    Filter(
        "the software runs cp with pp",
        "pp",
        lambda s, c: s.runs.cp_with_pp or c["cp"] == 1 or c["pp"] == 1,
    ),
    Filter(
        "the software splits the layers over pp",
        "pp",
        lambda s, c: s.runs.splits(s.model.n_layer, c["pp"]),
    ),
    Filter("HSDP's replica groups divide dp", "dp", lambda s, c: c["dp"] % s.replicas == 0),
    Filter(
        "dp·micro_batch divides the global batch",
        "micro_batch",
        lambda s, c: s.global_batch % (c["dp"] * c["micro_batch"]) == 0,
        _batch_rejection,
    ),
    Filter("interleaving fits the layers and micro-batches", "virtual_stages", _interleaving_fits),
    Filter("the software interleaves these stages", "virtual_stages", _interleaving_runs),
    Filter("the trainer pipelines these stages", "pp_schedule", _pipeline_runs),
    # all-to-all swaps sequence shards for head shards: tp's heads must split over cp
    Filter(
        "Ulysses splits tp's heads over cp",
        "cp_impl",
        lambda s, c: c["cp_impl"] != "ulysses" or not s.refusal(c["tp"], c["cp"], "ulysses"),
    ),
    Filter(
        "HSDP shards the states (ZeRO >= 2)",
        "zero_stage",
        lambda s, c: s.replicas == 1 or c["zero_stage"] >= 2,
    ),
)
