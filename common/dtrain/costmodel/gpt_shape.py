"""dtrain's GPT (dtrain.model.args.GPTConfig, or any object with its fields) in the cost model's
terms.

The cost model owns this conversion: the trainer-side modules (dtrain.train.memory_fit) and the
calibration readers both call it, so no cost-model module reaches up into them for it.
"""

from __future__ import annotations

from .moe_model import MoEModel, MoESpec
from .shapes import ModelShape


def shape_of(g) -> ModelShape:
    """A GPTConfig as a ModelShape (GELU MLP, no dropout; learned positions counted as tiny)."""
    return ModelShape(
        g.n_layer,
        g.d_model,
        g.n_head,
        g.n_kv_head,
        g.vocab_size,
        g.seq_len,
        float(g.mlp_ratio),
        False,
        g.tie_embeddings,
        name="run",
    )


def moe_model_of(g) -> MoEModel:
    """An MoE GPTConfig (``g.moe`` set) as the cost model's ``MoEModel``: its dense shape
    (``shape_of``: GELU, so every MLP of 2 matrices), the experts of ``g.moe.ffn`` (the dense
    hidden width when unset), the shared experts as the GPT builds them (one MLP of
    shared_experts x that width), balanced routing (ρ 1.0) and the all-to-all dispatcher the
    trainer runs."""
    m = g.moe
    ffn = m.ffn(g.mlp_hidden)
    spec = MoESpec(m.experts, m.top_k, ffn, m.shared_experts, ffn, m.dense_layers)
    return MoEModel(shape_of(g), spec, name="run")
