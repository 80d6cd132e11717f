"""An MoE model's memory per GPU in the cost model (issue 41): the dense proxy's memory with its
routed weights replaced by the experts' (E/ep experts per rank, /etp, their states sharded by the
ZeRO stage over ``expert_shard_group``: Megatron's estimator puts the expert optimizer state over
the expert-data-parallel group; FSDP2 + EP over efsdp), the attention weights the proxy misses
(MLA, ``--head-dim``), and the routed activations (the permuted tokens' k copies and ρ's extra
rows)."""

from __future__ import annotations

from .activations import held_layer_microbatches
from .memory import MemoryBreakdown
from .model_states import model_state_bytes
from .moe_layout import rank_tokens, rho, stage_moe_layers
from .moe_model import MoEModel
from .shapes import Layout, stage_layers


def expert_params_per_gpu(model: MoEModel, lay: Layout) -> float:
    """Routed-expert weights on the busiest rank: its stage's MoE layers x E/ep experts / etp."""
    return stage_moe_layers(model, lay) * model.expert_params() / (lay.ep * lay.etp)


def _proxy_routed_per_gpu(model: MoEModel, lay: Layout) -> float:
    """The routed weights the proxy holds on a rank (top_k experts' width, split over tp)."""
    return stage_moe_layers(model, lay) * model.routed_active_params() / lay.tp


def expert_shard_group(lay: Layout) -> int:
    """Ranks the experts' states shard over: efsdp (one HSDP replica's), or every expert-data-
    parallel rank without ZeRO."""
    return lay.efsdp if lay.zero_stage else lay.expert_dp


def moe_memory(
    model: MoEModel,
    lay: Layout,
    proxy: MemoryBreakdown,
    grad_bytes: int = 4,
    optimizer_states: str = "fp32",
    activation_factor: float = 1.0,
) -> tuple[MemoryBreakdown, dict]:
    """The proxy's memory with its routed weights replaced by the experts (sharded over
    ``expert_shard_group``), MLA / head-dim attention weights added, and the routed activations:
    per MoE layer and micro-batch held, the k permuted copies of each token and the experts'
    outputs before the combine (2·2·T·k·h bytes), ρ x the k·c·F MLP rows the proxy counts once
    (SwiGLU's 3 F-wide tensors, GELU's 2)
    (the extra (ρ−1)), none with full recompute (a layer's input alone is kept)."""
    m, d = model.moe, model.base.d_model
    expert = expert_params_per_gpu(model, lay)
    routed = _proxy_routed_per_gpu(model, lay)
    attn = stage_layers(model.base, lay.pp, lay.pp_split) * model.attention_extra_params() / lay.tp
    states = [
        model_state_bytes(p, lay.zero_stage, g, grad_bytes, optimizer_states)
        for p, g in (
            (expert, expert_shard_group(lay)),
            (routed, lay.shard_group),
            (attn, lay.shard_group),
        )
    ]
    (pe, ge, oe), (pr, gr, orr), (pa, ga, oa) = states
    # ZeRO-3's gathered working set (``memory.memory_per_gpu``): under PP the stage's weights and
    # fp32 gradients, (2 + grad_bytes)·Ψ; else three layers' bf16 weights. The proxy's routed
    # weights leave it, the experts' enter it where their states are sharded (efsdp > 1).
    buffers = proxy.buffers
    if lay.zero_stage == 3:
        layer_r = model.routed_active_params() / lay.tp
        layer_e = model.expert_params() / (lay.ep * lay.etp)
        if lay.shard_group > 1:
            buffers -= (2 + grad_bytes) * routed if lay.pp > 1 else 3 * 2 * layer_r
        if expert_shard_group(lay) > 1:
            buffers += (2 + grad_bytes) * expert if lay.pp > 1 else 3 * 2 * layer_e
        buffers = max(buffers, 0.0)
    acts = 0.0
    if lay.recompute != "full":
        t = rank_tokens(model, lay)
        r = rho(model, lay)
        per_layer = 2 * t * d * (2 * m.top_k * r - 1) + (r - 1) * t * m.top_k * (
            2 * model.mlp_matrices * m.expert_ffn / lay.etp
        )
        held = held_layer_microbatches(model.proxy, lay)
        share = stage_moe_layers(model, lay) / max(
            stage_layers(model.base, lay.pp, lay.pp_split), 1
        )
        acts = per_layer * held * share * activation_factor
    mem = MemoryBreakdown(
        params=proxy.params - pr + pe + pa,
        grads=proxy.grads - gr + ge + ga,
        optimizer=proxy.optimizer - orr + oe + oa,
        activations=proxy.activations + acts,
        buffers=buffers,
    )
    terms = {
        "expert_params_per_gpu": expert,
        "expert_state_bytes": pe + ge + oe,
        "expert_shard_group": expert_shard_group(lay),
        "routed_activation_bytes": acts,
    }
    return mem, terms
