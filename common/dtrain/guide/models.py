"""The guide's named models: which sizes its tables use, and the one table of their shapes.

The shapes are ``dtrain.costmodel.shapes.KNOWN_SHAPES`` (what ``dtrain plan --params`` plans), so a
size names one model in the decision matrix, the long-context table, the rules and the plan the
guide points to. Where Llama 3 has a size (8B, 70B, 405B) the guide uses that shape.
"""

from __future__ import annotations

from dataclasses import replace

from dtrain.costmodel.shapes import KNOWN_SHAPES, KNOWN_SOURCES, ModelShape

MATRIX_MODELS = (1e9, 8e9, 13e9, 34e9, 70e9, 175e9, 405e9)  # nominal sizes, the matrix's rows
LONG_MODELS = (8e9, 70e9, 405e9)  # the long-context table's: Llama 3, whose context reaches 128K


def model_label(params: float) -> str:
    return f"{params / 1e9:g}B"


def shape(params: float, seq_len: int) -> ModelShape:
    """The guide's model of nominal size ``params`` (a key of KNOWN_SHAPES) at ``seq_len``."""
    return replace(KNOWN_SHAPES[params], seq_len=seq_len)


def models_section() -> list[str]:
    """The table of every model the guide's tables use, each row cited."""
    out = [
        "## Models",
        "",
        "Every table and rule of this guide uses these shapes: a size names one model "
        "throughout, and "
        "`dtrain plan --params <size>` plans the same one. Where Llama 3 has the size (8B, 70B, "
        "405B) it is the Llama 3 shape; the other sizes keep theirs. Gated = SwiGLU (three MLP "
        "matrices); the Llama models use RoPE and no dropout, GPT-3 learned positions, "
        "dropout and tied embeddings.",
        "",
        "| size | model | parameters | layers | hidden | heads | KV heads | MLP width | gated "
        "| vocabulary | source |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for p in sorted(set(MATRIX_MODELS) | set(LONG_MODELS)):
        s = KNOWN_SHAPES[p]
        out.append(
            f"| {model_label(p)} | {s.name} | {s.num_params() / 1e9:.1f}B | {s.n_layer} | "
            f"{s.d_model:,} | {s.n_head} | {s.n_kv_head} | {s.ffn_hidden:,} | "
            f"{'yes' if s.gated_mlp else 'no'} | {s.vocab:,} | {KNOWN_SOURCES[p]} |"
        )
    return out + [""]
