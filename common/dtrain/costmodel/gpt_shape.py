"""dtrain's GPT (dtrain.model.args.GPTConfig, or any object with its fields) in the cost model's
terms.

The cost model owns this conversion: the trainer-side modules (dtrain.train.memory_fit) and the
calibration readers both call it, so no cost-model module reaches up into them for it.
"""

from __future__ import annotations

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
