"""FLOPs per token of a model: the model FLOPs of the MFU convention (``model_flops_per_token``,
``dtrain.model.flops``'s one formula) and the FLOPs its kernels execute
(``executed_flops_per_token``: causal attention half, recompute counted)."""

from __future__ import annotations

from functools import lru_cache

from dtrain.model.flops import transformer_flops_per_token

from .shapes import ModelShape


@lru_cache(maxsize=1 << 10)
def model_flops_per_token(shape: ModelShape) -> float:
    """``dtrain.model.flops.transformer_flops_per_token`` of ``shape`` (lm_head kept when tied)."""
    return transformer_flops_per_token(
        shape.n_layer,
        shape.d_model,
        shape.n_head,
        shape.n_kv_head,
        shape.ffn_hidden,
        shape.vocab,
        shape.seq_len,
        shape.gated_mlp,
    )


FLOP_CONVENTION = (
    "6N + 12·L·h·s per token, attention non-causal, recompute not counted: the MFU convention "
    "of PaLM, Megatron-LM and torchtitan"
)
EXECUTED_CONVENTION = "causal attention counted half, the recompute's re-run forward counted"


def _shape_flops(shape: ModelShape, vocab: int, seq_len: int) -> float:
    return transformer_flops_per_token(
        shape.n_layer,
        shape.d_model,
        shape.n_head,
        shape.n_kv_head,
        shape.ffn_hidden,
        vocab,
        seq_len,
        shape.gated_mlp,
    )


@lru_cache(maxsize=1 << 10)
def executed_flops_per_token(shape: ModelShape, recompute: str = "none") -> float:
    """FLOPs per token the kernels execute (the hardware FLOPs), from the same formula as
    ``model_flops_per_token``: its attention term (12·L·h·s, non-causal) halved by the causal
    mask, plus what activation checkpointing runs again: the layers' forward (full: a third of
    their matmuls plus the causal attention forward), the attention core's forward (selective),
    or torchtitan's op policy's wk, wo and w3 (or fc2) forward GEMMs (op)."""
    model = model_flops_per_token(shape)
    attention = model - _shape_flops(shape, shape.vocab, 0)
    layers_fwd = _shape_flops(shape, 0, 0) / 3  # forward of the layers' matmuls (no lm_head)
    attention_fwd = attention / 2 / 3  # causal forward
    hd = shape.d_model // shape.n_head
    op_fwd = (
        2
        * shape.n_layer
        * (
            shape.d_model * shape.n_kv_head * hd
            + shape.n_head * hd * shape.d_model
            + shape.d_model * shape.ffn_hidden
        )
    )
    extra = {
        "full": layers_fwd + attention_fwd,
        "selective": attention_fwd,
        "op": op_fwd,
    }.get(recompute, 0.0)
    return model - attention / 2 + extra
