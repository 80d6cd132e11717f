"""Model FLOPs of a transformer training step: one formula for the model, the cost model, the
guide and the backtest (no torch import, so the cost model stays light)."""

from __future__ import annotations

from typing import NamedTuple

from dtrain.model.args import GPTConfig, transformer_params


def transformer_flops_per_token(
    n_layer: int,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    ffn_hidden: int,
    vocab: int,
    seq_len: int,
    gated_mlp: bool = False,
    head_dim: int | None = None,
) -> int:
    """Training model FLOPs per token of a decoder-only transformer: the ONE FLOP formula of the
    project (GPT here, the cost model, the guide's local checks and the backtest all call it).

        6 * N_matmul + 12 * n_layer * n_head * head_dim * seq_len
        N_matmul = n_layer * (d*(n_head*hd) [wq] + 2*d*(n_kv_head*hd) [wk, wv] + (n_head*hd)*d [wo]
                              + (3 if gated else 2) * d * ffn_hidden) + vocab * d [lm_head]

    Forward 2 FLOPs per multiply-accumulate, backward twice the forward (dgrad + wgrad): 6 per
    weight per token (Narayanan et al. 2021, App. "Floating-point operations"; Megatron-LM
    ``training.num_floating_point_operations``, whose 12·L·h²·(... + s/h + V/(2·L·h)) it equals
    for SwiGLU with ``gated_mlp``). The lm_head matmul is counted even when it shares the token
    embedding's matrix (tied embeddings): the matmul still runs, as torchtitan's
    ``models/utils.py`` (get_nparams_and_flops) keeps it. The embedding lookup, norms and biases
    are not matmuls and are left out.

    Causal-attention convention: the attention term counts the FULL s x s score (QK^T) and value
    (AV) matmuls, 2·2·s·hd per head per token forward, not the causal half, as PaLM (App. B),
    Megatron-LM and torchtitan do, so MFU and TFLOP/s are comparable with theirs.
    """
    hd = head_dim or d_model // n_head
    matmul = transformer_params(
        n_layer, d_model, n_head, n_kv_head, ffn_hidden, vocab, gated_mlp=gated_mlp, head_dim=hd
    ).matmul
    return 6 * matmul + 12 * n_layer * n_head * hd * seq_len


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token of GPT(cfg): ``transformer_flops_per_token`` (6·N_matmul +
    12·L·H·hd·T, lm_head included when tied, full non-causal attention), equal to torchtitan's
    ``6*N + 12*L*H*Q*T`` and to ``6 * num_matmul_params(cfg) + attention``."""
    return transformer_flops_per_token(
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.mlp_hidden,
        cfg.vocab_size,
        seq_len or cfg.seq_len,
        False,
        cfg.head_dim,
    )


class MLA(NamedTuple):
    """DeepSeek's multi-head latent attention as a shape (DeepSeek-V2 report §2.1; V3 config:
    q_lora_rank 1536, kv_lora_rank 512, qk_rope_dim 64, qk_nope_dim 128, v_head_dim 128)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_dim: int
    qk_nope_dim: int
    v_head_dim: int


def attention_matmul_params(
    d_model: int, n_head: int, n_kv_head: int, head_dim: int | None = None, mla: MLA | None = None
) -> int:
    """One layer's attention projection weights. Standard: wq, wo (d x H·hd) and wk, wv
    (d x KV·hd); MLA as Megatron's ``theoretical_memory_usage.py`` counts it, norms left out
    (no matmul): q_lora·(d + H·(nope+rope)) + kv_lora·(d + H·(nope+v)) + d·rope + H·v·d (without
    a q LoRA, d·H·(nope+rope))."""
    if mla is None:
        hd = head_dim or d_model // n_head
        return 2 * d_model * n_head * hd + 2 * d_model * n_kv_head * hd
    qk = mla.qk_nope_dim + mla.qk_rope_dim
    q = mla.q_lora_rank * (d_model + n_head * qk) if mla.q_lora_rank else d_model * n_head * qk
    kv = mla.kv_lora_rank * (d_model + n_head * (mla.qk_nope_dim + mla.v_head_dim))
    return q + kv + d_model * mla.qk_rope_dim + n_head * mla.v_head_dim * d_model


def moe_flops_per_token(
    n_layer: int,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    vocab: int,
    seq_len: int,
    *,
    dense_ffn: int,
    dense_layers: int,
    top_k: int,
    expert_ffn: int,
    shared_ffn: int = 0,
    head_dim: int | None = None,
    mla: MLA | None = None,
) -> int:
    """Training model FLOPs per token of an MoE transformer by Megatron-LM's rule
    (``training.num_floating_point_operations``): the same 6 per weight per token as
    ``transformer_flops_per_token`` over the weights a token meets, SwiGLU MLPs (3 matrices):

        6 · (L·attention + 3·d·(D·dense_ffn + (L−D)·(top_k·expert_ffn + shared_ffn)) + V·d)
        + 6·L·s·H·(d_qk + d_v)                      (d_qk = d_v = head dim without MLA)

    ``shared_ffn`` is the shared experts' total width (S x their ffn; Megatron's
    moe_shared_expert_intermediate_size). The router (d x E per token) is not counted, as
    Megatron does not, so model TFLOP/s compares with published MoE figures. Attention is
    non-causal, as in ``transformer_flops_per_token``, which this equals for a dense model
    (top_k = 0, D = L)."""
    hd = head_dim or d_model // n_head
    qk, v = (hd, hd) if mla is None else (mla.qk_nope_dim + mla.qk_rope_dim, mla.v_head_dim)
    attention = attention_matmul_params(d_model, n_head, n_kv_head, hd, mla)
    moe_layers = n_layer - dense_layers
    ffn = 3 * d_model * (dense_layers * dense_ffn + moe_layers * (top_k * expert_ffn + shared_ffn))
    matmul = n_layer * attention + ffn + vocab * d_model
    return 6 * matmul + 6 * n_layer * n_head * (qk + v) * seq_len
