"""The GPT's configuration and what follows from it alone: the parameter count (the project's one:
``transformer_params``; the FLOP count built on it is ``dtrain.model.flops``).

Without torch, so the command-line checks and the cost model can size and check a 7B model without
importing the framework that builds it (``dtrain.model.gpt`` builds it, and re-exports these names).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from dtrain.core.checks import integer_at_least, one_of
from dtrain.model.moe_args import MoEArgs, moe_params_delta


# GPTConfig's shape fields (each an integer >= 1): what a training record keeps of the model
MODEL_SHAPE = ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "mlp_ratio")


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None  # None = n_head (multi-head); fewer = grouped-query attention
    d_model: int = 128
    mlp_ratio: int = 4
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    bias: bool = False  # biases in the block linears and LayerNorm (never in lm_head)
    tie_embeddings: bool = False  # lm_head shares the token-embedding matrix
    init_std: float = 0.02
    moe: MoEArgs | None = None  # None: dense; the MoE feed-forward (dtrain.model.moe_args)

    def __post_init__(self):
        if isinstance(self.moe, dict):  # a record's model dict
            self.moe = MoEArgs(**self.moe)
        if self.moe is not None and not self.moe.enabled:
            self.moe = None  # experts=0: one value for a dense model
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for key in MODEL_SHAPE:
            integer_at_least(key, getattr(self, key), 1, error=ValueError)
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        one_of("norm", self.norm, ("rmsnorm", "layernorm"), error=ValueError)
        if self.moe is not None:
            self.moe.check(self.n_layer)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.d_model

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """The preset with `overrides` applied, checked as one whole model. Overriding n_head
        without n_kv_head keeps the preset's kind of attention: multi-head stays multi-head
        (n_kv_head follows n_head) instead of silently becoming GQA with the preset's k/v heads."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
        preset = PRESETS[name]
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(
                f"unknown model key {unknown[0]!r}: known keys are "
                f"{', '.join(f.name for f in fields(cls))}"
            )
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if (
            "n_head" in overrides
            and "n_kv_head" not in overrides
            and preset.n_kv_head == preset.n_head
        ):
            overrides["n_kv_head"] = None
        return replace(preset, **overrides)


# GPT-2 shapes keep GPT-2's conventions (LayerNorm with bias, tied embeddings, vocab 50257 padded
# to 50304) so their sizes match the names. "1b" and "7b" use modern conventions (RMSNorm, no bias,
# untied, vocab 32000); "7b" has Llama-2-7B's shape but a GELU 4x MLP instead of SwiGLU (8/3 x
# 3 matrices), which makes it 6.73B parameters instead of 6.74B.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64),
    "small": GPTConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=8, d_model=256),
    "125m": GPTConfig(
        vocab_size=50304,
        seq_len=1024,
        n_layer=12,
        n_head=12,
        d_model=768,
        norm="layernorm",
        bias=True,
        tie_embeddings=True,
    ),
    "350m": GPTConfig(
        vocab_size=50304,
        seq_len=1024,
        n_layer=24,
        n_head=16,
        d_model=1024,
        norm="layernorm",
        bias=True,
        tie_embeddings=True,
    ),
    "1b": GPTConfig(vocab_size=32000, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "7b": GPTConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, d_model=4096),
}


@dataclass(frozen=True)
class ParamCount:
    """A decoder-only transformer's parameters by part (``transformer_params``)."""

    n_layer: int
    per_layer: int  # one block: its linear layers, norms and biases
    matmul_per_layer: int  # one block's linear-layer weights
    token_embedding: int  # vocab x d_model
    lm_head: int  # d_model x vocab: its matmul runs even when tied to the token embedding
    positions: int  # learned position embeddings (0 with RoPE)
    final_norm: int
    tied: bool  # the lm_head is the token embedding's matrix (counted once)
    # an MoE model's blocks beyond the dense blocks above (dtrain.model.moe_args): all / matmul
    moe_extra: int = 0
    moe_extra_matmul: int = 0

    @property
    def total(self) -> int:
        blocks = self.n_layer * self.per_layer
        head = 0 if self.tied else self.lm_head
        blocks += self.moe_extra
        return self.token_embedding + self.positions + blocks + self.final_norm + head

    @property
    def matmul(self) -> int:
        """Weights of every linear layer, lm_head included when tied (its matmul still runs)."""
        return self.n_layer * self.matmul_per_layer + self.moe_extra_matmul + self.lm_head


def transformer_params(
    n_layer: int,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    ffn_hidden: int,
    vocab: int,
    *,
    gated_mlp: bool = False,
    tied_embeddings: bool = False,
    head_dim: int | None = None,
    norm_vectors: int = 1,
    bias: bool = False,
    positions: int = 0,
) -> ParamCount:
    """The project's one parameter count (the GPT here, the cost model's ModelShape and the FLOP
    formula all take theirs from it), as torchtitan's models/utils counts its models'.

    Per block: wq, wo (d x n_head·hd), wk, wv (d x n_kv_head·hd), the MLP's 2 matrices (3 gated), 2
    norms of ``norm_vectors`` vectors of d (1: RMSNorm or LayerNorm without bias; 2: with it) and,
    with ``bias``, the linears' biases. ``positions``: learned position embeddings (seq_len; 0:
    RoPE)."""
    hd = head_dim or d_model // n_head
    q, kv = n_head * hd, n_kv_head * hd
    mlp_in = (2 if gated_mlp else 1) * ffn_hidden
    matmul = 2 * d_model * q + 2 * d_model * kv + (mlp_in + ffn_hidden) * d_model
    biases = (q + 2 * kv + d_model + mlp_in + d_model) if bias else 0
    norm = norm_vectors * d_model
    return ParamCount(
        n_layer=n_layer,
        per_layer=matmul + 2 * norm + biases,
        matmul_per_layer=matmul,
        token_embedding=vocab * d_model,
        lm_head=d_model * vocab,
        positions=positions * d_model,
        final_norm=norm,
        tied=tied_embeddings,
    )


def model_dict(cfg: GPTConfig) -> dict:
    """GPTConfig as a record's dict: a dense model's has no ``moe`` key (as before MoE existed)."""
    d = asdict(cfg)
    if d["moe"] is None:
        del d["moe"]
    return d


def param_count(cfg: GPTConfig) -> ParamCount:
    """GPT(cfg)'s parameters by part: GELU MLP, learned positions, LayerNorm's bias with bias; an
    MoE model's MoE layers in ``moe_extra`` (all experts: the parameters held, not those a token
    uses)."""
    norm_vectors = 2 if cfg.norm == "layernorm" and cfg.bias else 1
    count = _dense_param_count(cfg, norm_vectors)
    if cfg.moe is None:
        return count
    extra, extra_matmul = moe_params_delta(
        cfg.moe, cfg.n_layer, cfg.d_model, cfg.mlp_hidden, cfg.bias
    )
    return replace(count, moe_extra=extra, moe_extra_matmul=extra_matmul)


def _dense_param_count(cfg: GPTConfig, norm_vectors: int) -> ParamCount:
    return transformer_params(
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.mlp_hidden,
        cfg.vocab_size,
        tied_embeddings=cfg.tie_embeddings,
        head_dim=cfg.head_dim,
        norm_vectors=norm_vectors,
        bias=cfg.bias,
        positions=cfg.seq_len,
    )


def num_params(cfg: GPTConfig, *, exclude_embeddings: bool = False) -> int:
    """Parameter count of GPT(cfg), equal to ``sum(p.numel() for p in model.parameters())``.

    ``exclude_embeddings`` drops the position embedding and the token embedding; with tied
    embeddings the shared matrix is kept, since it does the lm_head's matmul (as in nanoGPT)."""
    n = param_count(cfg)
    if not exclude_embeddings:
        return n.total
    return n.total - n.positions - (0 if n.tied else n.token_embedding)


def num_matmul_params(cfg: GPTConfig) -> int:
    """Weights of all linear layers, lm_head included (even when tied: its matmul still runs).
    Embedding lookups, norms and biases do no matmul and are left out, like torchtitan, which
    subtracts the token embedding from N."""
    return param_count(cfg).matmul
