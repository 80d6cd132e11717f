"""The shape of a mixture-of-experts model in the cost model (issue 41): the routed feed-forward
(``MoESpec``), the decoder around it (``MoEModel``: its parameters, active parameters and FLOPs) and
its *dense proxy* (``MoEModel.proxy``), the dense model a token meets, which the dense cost model
prices (``moe_cost`` adds the routed experts' terms)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from dtrain.model.flops import MLA, attention_matmul_params, moe_flops_per_token

from .hashing import cached_hash
from .shapes import ModelShape

DISPATCHERS = ("alltoall", "allgather", "deepep")


@dataclass(frozen=True)
class MoESpec:
    """The routed feed-forward: ``experts`` of width ``expert_ffn``, ``top_k`` per token,
    ``shared_experts`` always on (each ``shared_ffn`` wide; 0: ``expert_ffn``), the first
    ``dense_layers`` dense. ``imbalance`` ρ: the busiest rank's tokens over the balanced count
    (Megatron's overload factor). ``dispatcher``: alltoall, allgather or deepep;
    ``a2a_overlap``: dispatch/combine hidden behind other micro-batches' compute."""

    __hash__ = cached_hash

    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    imbalance: float = 1.0
    dispatcher: str = "alltoall"
    a2a_overlap: bool = False

    def __post_init__(self) -> None:
        if min(self.experts, self.top_k, self.expert_ffn) < 1:
            raise ValueError("experts, top_k and expert_ffn must be >= 1")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if min(self.shared_experts, self.shared_ffn, self.dense_layers) < 0:
            raise ValueError("shared_experts, shared_ffn and dense_layers must be >= 0")
        if not self.imbalance >= 1.0:
            raise ValueError(f"imbalance must be >= 1.0 (1.0 = balanced), got {self.imbalance}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")

    @property
    def shared_total(self) -> int:
        """The shared experts' total FFN width (Megatron's moe_shared_expert_intermediate_size)."""
        return self.shared_experts * (self.shared_ffn or self.expert_ffn)


@dataclass(frozen=True)
class MoEModel:
    """An MoE decoder: ``base`` holds the attention, the vocabulary, the layers and the dense
    layers' FFN (``base.ffn_hidden``); every MLP, dense, routed and shared, of ``mlp_matrices``
    (``base.gated_mlp``: SwiGLU's 3, as the released MoE models; else GELU's 2, as dtrain's GPT,
    ``gpt_shape.moe_model_of``); ``head_dim`` when heads x head dim is not d_model
    (Qwen3, GPT-OSS); ``mla`` DeepSeek's latent attention."""

    __hash__ = cached_hash

    base: ModelShape
    moe: MoESpec
    head_dim: int = 0
    mla: MLA | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.moe.dense_layers >= self.base.n_layer:
            raise ValueError(
                f"dense_layers={self.moe.dense_layers} leaves no MoE layer of {self.base.n_layer}"
            )

    @property
    def moe_layers(self) -> int:
        return self.base.n_layer - self.moe.dense_layers

    @property
    def hd(self) -> int:
        return self.head_dim or self.base.d_model // self.base.n_head

    @cached_property
    def proxy(self) -> ModelShape:
        """The dense model a token meets: FFN width averaged over the layers (see the module
        docstring)."""
        b, m = self.base, self.moe
        active = m.dense_layers * b.ffn_hidden + self.moe_layers * (
            m.top_k * m.expert_ffn + m.shared_total
        )
        return replace(b, ffn_mult=active / b.n_layer / b.d_model)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of each MLP: 3 gated (SwiGLU), 2 not (GELU)."""
        return 3 if self.base.gated_mlp else 2

    def attention_params(self) -> int:
        b = self.base
        return attention_matmul_params(b.d_model, b.n_head, b.n_kv_head, self.hd, self.mla)

    def attention_extra_params(self) -> int:
        """Per layer, attention weights the proxy (d/H head dim, no MLA) does not count."""
        b = self.base
        return self.attention_params() - attention_matmul_params(b.d_model, b.n_head, b.n_kv_head)

    def expert_params(self) -> int:
        """One MoE layer's routed experts: E x c·d·F (c = ``mlp_matrices``)."""
        return self.moe.experts * self.mlp_matrices * self.base.d_model * self.moe.expert_ffn

    def routed_active_params(self) -> int:
        """One MoE layer's routed weights a token meets (what the proxy holds for them)."""
        return self.moe.top_k * self.mlp_matrices * self.base.d_model * self.moe.expert_ffn

    def num_params(self) -> int:
        """Total parameters (Megatron's count: every expert; norms, router included)."""
        b, m = self.base, self.moe
        d = b.d_model
        router = d * m.experts
        c = self.mlp_matrices
        dense_layer = self.attention_params() + c * d * b.ffn_hidden + 2 * d
        moe_layer = (
            self.attention_params() + self.expert_params() + c * d * m.shared_total + 2 * d + router
        )
        embed = b.vocab * d * (1 if b.tied_embeddings else 2)
        return m.dense_layers * dense_layer + self.moe_layers * moe_layer + embed + d

    def active_params(self) -> int:
        """Parameters a token meets (top_k routed experts of E)."""
        return self.num_params() - self.moe_layers * (
            self.expert_params() - self.routed_active_params()
        )

    def flops_per_token(self) -> float:
        """Model FLOPs per token by Megatron's MoE rule (``dtrain.model.flops``)."""
        b, m = self.base, self.moe
        return moe_flops_per_token(
            b.n_layer,
            b.d_model,
            b.n_head,
            b.n_kv_head,
            b.vocab,
            b.seq_len,
            dense_ffn=b.ffn_hidden,
            dense_layers=m.dense_layers,
            top_k=m.top_k,
            expert_ffn=m.expert_ffn,
            shared_ffn=m.shared_total,
            head_dim=self.hd,
            mla=self.mla,
            gated=self.base.gated_mlp,
        )
