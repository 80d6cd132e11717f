"""The MoE feed-forward's configuration (``model.moe.*``) and what follows from it alone, without
torch: the one home of its defaults (the Hydra node ``model.moe`` is this dataclass) and of its
parameter terms (``dtrain.model.args`` adds them to the GPT's; the FLOPs:
``dtrain.model.flops.moe_flops_per_token``, the one MoE FLOP rule).

    experts          routed experts per MoE layer (0: the model is dense)
    top_k            experts each token is sent to
    expert_ffn       each expert's hidden width (null: the dense MLP's, mlp_ratio x d_model)
    shared_experts   experts every token passes through (DeepSeek-V3), one MLP of their width
    dense_layers     the first layers keep the dense MLP (DeepSeek-V3: 3)
    router           softmax: softmax over the experts, top-k, renormalised (Mixtral, Qwen3);
                     sigmoid: sigmoid scores, top-k over score + a bias that only selects, the
                     weights the selected scores normalised (DeepSeek-V3, auxiliary-loss-free)
    bias_update_rate sigmoid: after each step bias_i += rate * sign(mean load - load_i)
                     (DeepSeek-V3's gamma, 0.001; 0 = no update)
    aux_loss_coef    Switch Transformer's load-balancing loss, coef * E * sum_i f_i * P_i (0: off)
    capacity_factor  null: dropless (every routed token is computed); c > 0: each expert takes
                     at most ceil(c * tokens * top_k / experts) of a rank's tokens, the rest of
                     its assignments are dropped (their weight is lost, as in Switch / GShard)
    gemm             auto | grouped | loop | padded: the experts' GEMMs as one grouped GEMM
                     (torch._grouped_mm; auto picks it on CUDA sm90+ in bf16), a loop over the
                     experts (the reference), or a padded batched matmul (the grouped GEMM
                     emulated in plain torch)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dtrain.core.checks import integer_at_least, one_of

ROUTERS = ("softmax", "sigmoid")
GEMMS = ("auto", "grouped", "loop", "padded")


@dataclass
class MoEArgs:
    experts: int = 0
    top_k: int = 2
    expert_ffn: Optional[int] = None
    shared_experts: int = 0
    dense_layers: int = 0
    router: str = "softmax"
    bias_update_rate: float = 0.001
    aux_loss_coef: float = 0.0
    capacity_factor: Optional[float] = None
    gemm: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.experts > 0

    def check(self, n_layer: int, error: type[Exception] = ValueError) -> None:
        """Values that cannot build an MoE model, one line each (`error`: the caller's type)."""
        integer_at_least("moe.experts", self.experts, 0, error=error)
        if not self.enabled:
            return
        integer_at_least("moe.top_k", self.top_k, 1, high=self.experts, error=error)
        integer_at_least("moe.expert_ffn", self.expert_ffn, 1, nullable=True, error=error)
        integer_at_least("moe.shared_experts", self.shared_experts, 0, error=error)
        integer_at_least("moe.dense_layers", self.dense_layers, 0, high=n_layer - 1, error=error)
        one_of("moe.router", self.router, ROUTERS, error=error)
        one_of("moe.gemm", self.gemm, GEMMS, error=error)
        for key in ("bias_update_rate", "aux_loss_coef"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise error(f"moe.{key}={value!r} must be a finite number >= 0")
        cf = self.capacity_factor
        if cf is not None and (
            not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf <= 0
        ):
            raise error(f"moe.capacity_factor={cf!r} must be a finite number > 0 or null")

    def ffn(self, dense_hidden: int) -> int:
        """One expert's hidden width."""
        return self.expert_ffn or dense_hidden

    def is_moe_layer(self, layer: int) -> bool:
        return self.enabled and layer >= self.dense_layers

    def moe_layers(self, n_layer: int) -> int:
        return max(n_layer - self.dense_layers, 0) if self.enabled else 0

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes from `tokens` local tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


def moe_layer_params(moe: MoEArgs, d_model: int, dense_hidden: int) -> int:
    """One MoE feed-forward's parameters, all matmul weights (no biases): the router (d x E), E
    experts and the shared MLP (2 matrices of d x ffn each, ffn x shared_experts for the shared)."""
    f = moe.ffn(dense_hidden)
    return d_model * moe.experts + (moe.experts + moe.shared_experts) * 2 * d_model * f


def moe_params_delta(moe: MoEArgs, n_layer: int, d_model: int, dense_hidden: int, bias: bool):
    """(all parameters, matmul weights) an MoE model has beyond its dense twin (the dense MLP of
    each MoE layer replaced by the MoE layer)."""
    layers = moe.moe_layers(n_layer)
    dense_matmul = 2 * d_model * dense_hidden
    dense = dense_matmul + ((dense_hidden + d_model) if bias else 0)
    moe_layer = moe_layer_params(moe, d_model, dense_hidden)
    return layers * (moe_layer - dense), layers * (moe_layer - dense_matmul)
