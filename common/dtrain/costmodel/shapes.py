"""The model (``ModelShape``) and how a step is parallelised over GPUs (``Layout``): the cost
model's two inputs.

``KNOWN_SHAPES`` are the standard models the decision matrix and ``ModelShape.from_params`` use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from dtrain.model.args import ParamCount, transformer_params

from .hashing import cached_hash

# The layout vocabulary and the type itself are dtrain.core.layout's (one type for the trainer, the
# mesh, the contract and this model); re-exported here, where the cost model has always read them.
from dtrain.core.layout import CP_IMPLS, PP_SCHEDULES, PP_SPLITS, RECOMPUTE, Layout  # noqa: F401


def params_text(n: float) -> str:
    """A parameter count as people write it: 405B, 1.24B, 2T, 20M, 125M (3 significant digits)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. ``ffn_mult`` is MLP hidden / d_model; ``gated_mlp`` = SwiGLU.

    ``dropout``: trained with dropout layers (hidden and attention dropout, as Megatron-LM's
    defaults of 0.1 and the GPT-3-style models of Korthikanti et al. 2022). Llama-style models
    have none (Touvron et al. 2023 use no dropout; torchtitan's and dtrain's models have no
    dropout layer), which is the default: no dropout masks are stored for backward.
    """

    __hash__ = cached_hash

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    vocab: int
    seq_len: int
    ffn_mult: float = 4.0
    gated_mlp: bool = False
    tied_embeddings: bool = False
    name: str = ""
    dropout: bool = False
    rotary: bool = True  # RoPE on q and k (GPT-3-style models add learned positions to the input)

    def __post_init__(self) -> None:
        sizes = ("n_layer", "d_model", "n_head", "n_kv_head", "vocab", "seq_len")
        if min(getattr(self, k) for k in sizes) < 1:
            bad = next(k for k in sizes if getattr(self, k) < 1)
            raise ValueError(f"{bad}={getattr(self, bad)} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head} "
                "(the head dim must be a whole number)"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head} "
                "(each k/v head serves a whole group of query heads)"
            )

    @property
    def ffn_hidden(self) -> int:
        return int(round(self.ffn_mult * self.d_model))

    @cached_property
    def param_count(self) -> ParamCount:
        """dtrain.model.args.transformer_params of this shape: RMSNorm, no biases, no learned
        positions (a non-rotary model's are too few to count). Cached: the search asks per
        layout."""
        return transformer_params(
            self.n_layer,
            self.d_model,
            self.n_head,
            self.n_kv_head,
            self.ffn_hidden,
            self.vocab,
            gated_mlp=self.gated_mlp,
            tied_embeddings=self.tied_embeddings,
        )

    def params_per_layer(self) -> int:
        """Attention q,k,v,o + MLP (2 matrices, 3 if gated) + 2 norms; no biases.

        A GPT with GELU 4x MLP and n_kv_head = n_head gives the familiar 12·h² + 2h per layer.
        """
        return self.param_count.per_layer

    def params_per_layer_on_rank(self, tp: int) -> float:
        """One layer's parameters on one of ``tp`` ranks: everything split tp ways except K and
        V, of which each rank keeps whole heads (replicated when tp > n_kv_head, as Megatron and
        dtrain do)."""
        hd = self.d_model // self.n_head
        kv, kv_local = (
            2 * self.d_model * self.n_kv_head * hd,
            2 * self.d_model * hd * max(self.n_kv_head // tp, 1),
        )
        return (self.params_per_layer() - kv) / tp + kv_local

    def embedding_params(self) -> int:
        """Input embedding plus output projection (one matrix when tied); positions use RoPE."""
        n = self.param_count
        return n.token_embedding + (0 if n.tied else n.lm_head)

    def num_params(self) -> int:
        return self.param_count.total

    @classmethod
    def from_params(cls, params: float, seq_len: int = 4096) -> ModelShape:
        """A standard shape with about ``params`` parameters (``KNOWN_SHAPES`` table).

        Within ±10 % of a known model's nominal size its shape is returned as is (seq_len
        replaced), so ``from_params(70e9)`` is Llama-3-70B (70.6e9 parameters). Otherwise d_model is
        interpolated geometrically (log-linear in parameter count) between the two neighbouring
        known shapes, rounded to a multiple of 8 heads; head size, KV-head count, MLP ratio (the
        width rounded to a multiple of 256) and vocabulary come from the nearer neighbour, and
        n_layer is solved for the parameter count.
        """
        if params <= 0:
            raise ValueError(f"params must be positive, got {params}")
        for nominal, shape in KNOWN_SHAPES.items():
            if abs(params / nominal - 1) <= 0.10:
                return replace(shape, seq_len=seq_len)
        known = sorted(((s.num_params(), s) for s in KNOWN_SHAPES.values()), key=lambda x: x[0])
        i = min(max(sum(n < params for n, _ in known), 1), len(known) - 1)
        (n_a, a), (n_b, b) = known[i - 1], known[i]
        f = math.log(params / n_a) / math.log(n_b / n_a)
        style = a if f < 0.5 else b
        head_dim = style.d_model // style.n_head
        d_raw = math.exp(math.log(a.d_model) + f * math.log(b.d_model / a.d_model))
        n_head = max(8, 8 * round(d_raw / head_dim / 8))
        n_kv = n_head if style.n_kv_head == style.n_head else math.gcd(n_head, style.n_kv_head)
        d_model = n_head * head_dim
        # the MLP width a real config would pick: a multiple of 256 (Llama's multiple_of), so
        # that every tp the heads allow also splits the MLP (the trainer and Megatron refuse less)
        ffn = max(256, 256 * round(style.ffn_mult * d_model / 256))
        probe = replace(
            style,
            n_layer=1,
            d_model=d_model,
            n_head=n_head,
            n_kv_head=n_kv,
            ffn_mult=ffn / d_model,
            seq_len=seq_len,
            name="",
        )
        rest = params - probe.embedding_params() - probe.d_model
        n_layer = max(1, round(rest / probe.params_per_layer()))
        return replace(probe, n_layer=n_layer, name=f"~{params_text(params)} (interpolated)")

    @classmethod
    def smallest_from_params(cls) -> ModelShape:
        """The smallest model ``from_params`` builds: below the smallest known shape it keeps
        that shape's style (GPT-3 Small's 64-dim heads, tied 50257-token vocabulary), at least 8
        heads and one layer, so a smaller count gets this model (28.9M parameters)."""
        return cls.from_params(1.0)


# The one table of named models: `dtrain plan --params`, and the guide's decision matrix, its
# long-context table and its rules (dtrain.guide.models), so "70B" is one model everywhere. Where
# Llama 3 has a size (8B, 70B, 405B) it is that shape; the other sizes keep the models they were
# (GPT-3's below 1B and at 175B, Llama 2's 7B and 13B, Code Llama's 34B). seq_len is replaced by
# the caller's. GPT-3 keeps dropout (the Megatron-LM-trained GPT-3 shapes Korthikanti et al. 2022
# model) and learned positions (no RoPE); the Llama family trains without dropout. Below 1B the
# table has GPT-3's small models: the Llama family's smallest (3.2 1B) has a 128256-token
# vocabulary, whose embedding alone would leave a 125M-parameter model one layer.
_GPT3 = dict(
    vocab=50257,
    seq_len=2048,
    ffn_mult=4.0,
    gated_mlp=False,
    tied_embeddings=True,
    dropout=True,
    rotary=False,
)
_L2, _L3 = dict(vocab=32000, seq_len=4096), dict(vocab=128256, seq_len=8192)


def _llama(layers: int, d: int, heads: int, kv: int, ffn: int, name: str, vocab: dict, **kw):
    """A Llama-family shape (SwiGLU, RoPE, no dropout) from its config's integers."""
    return ModelShape(
        layers, d, heads, kv, ffn_mult=ffn / d, gated_mlp=True, name=name, **vocab, **kw
    )


KNOWN_SHAPES = {  # nominal size -> shape (parameters as counted here in KNOWN_SOURCES' comments)
    125e6: ModelShape(12, 768, 12, 12, name="GPT-3-Small", **_GPT3),  # 1.25e8
    350e6: ModelShape(24, 1024, 16, 16, name="GPT-3-Medium", **_GPT3),  # 3.55e8
    760e6: ModelShape(24, 1536, 16, 16, name="GPT-3-Large", **_GPT3),  # 7.58e8
    1e9: _llama(16, 2048, 32, 8, 8192, "Llama-3.2-1B", _L3, tied_embeddings=True),  # 1.24e9
    7e9: _llama(32, 4096, 32, 32, 11008, "Llama-2-7B", _L2),  # 6.74e9
    8e9: _llama(32, 4096, 32, 8, 14336, "Llama-3-8B", _L3),  # 8.03e9
    13e9: _llama(40, 5120, 40, 40, 13824, "Llama-2-13B", _L2),  # 13.0e9
    34e9: _llama(48, 8192, 64, 8, 22016, "CodeLlama-34B", _L2),  # 33.7e9
    70e9: _llama(80, 8192, 64, 8, 28672, "Llama-3-70B", _L3),  # 70.6e9
    175e9: ModelShape(96, 12288, 96, 96, name="GPT-3-175B", **_GPT3),  # 174.6e9
    405e9: _llama(126, 16384, 128, 8, 53248, "Llama-3.1-405B", _L3),  # 405.9e9
}
# Where each row's integers (layers, d_model, heads, KV heads, MLP width, vocabulary, gated MLP)
# come from: the guide prints this beside its table of models.
KNOWN_SOURCES = {
    125e6: "Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1",
    350e6: "Brown et al. 2020, Table 2.1",
    760e6: "Brown et al. 2020, Table 2.1",
    1e9: "Meta's Llama 3.2 model card; meta-llama/Llama-3.2-1B config.json",
    7e9: "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-7b-hf config.json",
    8e9: "Llama Team 2024, The Llama 3 Herd of Models, Table 3; Meta-Llama-3-8B config.json",
    13e9: "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-13b-hf config.json",
    34e9: "Rozière et al. 2023 (Code Llama); codellama/CodeLlama-34b-hf config.json",
    70e9: "Llama Team 2024, Table 3; Meta-Llama-3-70B config.json",
    175e9: "Brown et al. 2020, Table 2.1",
    405e9: "Llama Team 2024, Table 3; Llama-3.1-405B config.json",
}


def _split(shape: ModelShape, pp: int, split: str) -> tuple[int, int]:
    """(slots per stage, ceil(slots/pp); slots each end stage gives to the embedding or the loss:
    0 or 1)."""
    ends = 1 if split == "balanced" and pp > 1 else 0
    return -(-(shape.n_layer + 2 * ends) // pp), ends


def stage_layers(shape: ModelShape, pp: int, split: str = "layers") -> int:
    """Transformer layers on the busiest pipeline stage: ceil(L/pp), pp need not divide L
    (Megatron's uneven first/last stages). With the "balanced" split, ceil((L+2)/pp) on a middle
    stage (two stages: one slot fewer)."""
    per, ends = _split(shape, pp, split)
    return per - ends if pp == 2 else per


def end_stage_layers(shape: ModelShape, layout: Layout) -> tuple[int, float]:
    """(transformer layers on the first stage, those of them in its first virtual chunk): the chunk
    the interleaved warm-up's extra micro-batches run (``activations.held_layer_microbatches``).
    "layers": ceil(L/pp), the chunk 1/v of it; "balanced": one slot fewer, the first chunk
    ceil((L+2)/(pp·v)) − 1 (the embedding is its missing layer:
    Llama 3 405B's 126 layers on 16 stages of 8 chunks leave the first chunk the embedding
    alone)."""
    per, ends = _split(shape, layout.pp, layout.pp_split)
    first = per - ends
    if not ends:
        return first, first / layout.virtual_stages
    chunk = -(-pipeline_slots(shape, layout) // (layout.pp * layout.virtual_stages))
    return first, max(min(chunk - 1, first), 0)


def last_stage_layers(shape: ModelShape, layout: Layout) -> int:
    """Transformer layers on the last stage, beside the output projection and loss: the remainder
    of the split."""
    per, ends = _split(shape, layout.pp, layout.pp_split)
    return max(pipeline_slots(shape, layout) - (layout.pp - 1) * per - ends, 0)


def pipeline_slots(shape: ModelShape, layout: Layout) -> int:
    """Layer slots the pipeline splits: the transformer layers, plus the embedding and the loss
    when "balanced"."""
    return shape.n_layer + 2 * _split(shape, layout.pp, layout.pp_split)[1]


@dataclass(frozen=True)
class _TrainerModel:
    """The fields of a ``dtrain.model.args.GPTConfig`` that the trainer's layout rules read."""

    n_head: int
    n_kv_head: int
    mlp_hidden: int
    seq_len: int


# The trainer's config names as ``dtrain plan`` spells them ("model.n_head" before "n_head").
_PLAN_NAMES = (
    ("train.sequence_parallel=true", "sp=on"),
    ("train.sequence_parallel", "sp=on"),
    ("model.seq_len=", "--seq "),
    ("model.seq_len", "--seq"),
    ("pick seq_len", "pick --seq"),
    ("model.n_head", "--heads"),
    ("n_kv_head=", "--kv-heads "),
    ("n_kv_head", "--kv-heads"),
    ("n_head=", "--heads "),
    ("train.cp_impl=", "cp_impl="),
    ("train.tp=", "tp="),
    ("train.tp", "tp"),
    ("train.cp=", "cp="),
    ("train.cp", "cp"),
)


@lru_cache(maxsize=4096)
def parallel_refusal(
    shape: ModelShape,
    tp: int = 1,
    cp: int = 1,
    cp_impl: str = "ring",
    sequence_parallel: bool = False,
) -> str | None:
    """Why the trainer refuses to split ``shape`` over ``tp`` and ``cp`` (None when it does not),
    in the plan's words. The rules are the trainer's own (``dtrain.parallel.feasibility``: heads,
    k/v heads and the MLP width over tp; the sequence over 2·cp zigzag chunks, and over tp with
    sequence parallelism; ulysses' heads), called rather than restated, so the plan never scores a
    layout the trainer cannot build. The embedding and lm_head stay whole on every tp rank there:
    the vocabulary has no rule."""
    from dtrain.core.errors import UserError
    from dtrain.parallel.feasibility import check_cp_model, check_tp_model

    model = _TrainerModel(shape.n_head, shape.n_kv_head, shape.ffn_hidden, shape.seq_len)
    try:
        check_tp_model(model, tp, sequence_parallel)
        check_cp_model(model, cp, cp_impl, tp, sequence_parallel)
    except UserError as e:
        # the rule after a "train.tp=8: " or "train.cp=2: " prefix names that degree itself
        text = str(e).removeprefix(f"train.tp={tp}: ").removeprefix(f"train.cp={cp}: ")
        for trainer, plan in _PLAN_NAMES:
            text = text.replace(trainer, plan)
        return text
    return None


@dataclass(frozen=True)
class _TrainerPipelineModel:
    """The fields of a ``GPTConfig`` that the trainer's pipeline rules read (the plan's overrides
    set model.preset=small, whose embeddings are untied)."""

    n_layer: int
    tie_embeddings: bool = False


@lru_cache(maxsize=4096)
def pipeline_refusal(
    n_layer: int, pp: int, schedule: str, virtual: int, micro_batches: int
) -> str | None:
    """Why the trainer refuses to pipeline ``n_layer`` layers over ``pp`` stages of ``virtual``
    chunks with ``schedule`` (its train.pp_schedule) and ``micro_batches`` per step; None when it
    runs them. The trainer's own ``dtrain.parallel.feasibility.check_pipeline``, called."""
    from dtrain.core.errors import UserError
    from dtrain.parallel.feasibility import check_pipeline

    try:
        check_pipeline(_TrainerPipelineModel(n_layer), pp, schedule, virtual, micro_batches)
    except UserError as e:
        return str(e)
    return None


def run_schedule(layout: Layout) -> str:
    """The train.pp_schedule the plan's overrides run ``layout`` with: its ``trainer_schedule``,
    or gpipe where 1F1B has fewer micro-batches than stages (the trainer's 1f1b needs >= pp)."""
    schedule = layout.trainer_schedule
    return "gpipe" if schedule == "1f1b" and layout.grad_accum < layout.pp else schedule
