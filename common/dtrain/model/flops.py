"""Model FLOPs of a transformer training step: one formula for the model, the cost model, the
guide and the backtest (no torch import, so the cost model stays light)."""

from __future__ import annotations

from dtrain.model.args import GPTConfig, transformer_params
from dtrain.model.moe_args import moe_active_matmul_delta


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
    ``6*N + 12*L*H*Q*T`` and to ``6 * num_matmul_params(cfg) + attention``. An MoE model counts
    the weights a token multiplies (Megatron's MoE rule: top_k routed + shared experts, the router
    left out): ``dtrain.model.moe_args.moe_active_matmul_delta``."""
    moe = 0
    if cfg.moe is not None:
        moe = 6 * moe_active_matmul_delta(cfg.moe, cfg.n_layer, cfg.d_model, cfg.mlp_hidden)
    return moe + transformer_flops_per_token(
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
