"""Model FLOPs of a transformer training step: one formula for the model, the cost model, the
guide and the backtest (no torch import, so the cost model stays light)."""
from __future__ import annotations


def transformer_flops_per_token(n_layer: int, d_model: int, n_head: int, n_kv_head: int, ffn_hidden: int,
                                vocab: int, seq_len: int, gated_mlp: bool = False, head_dim: int | None = None) -> int:
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
    q, kv = n_head * hd, n_kv_head * hd
    per_layer = d_model * q + 2 * d_model * kv + q * d_model + (3 if gated_mlp else 2) * d_model * ffn_hidden
    matmul = n_layer * per_layer + vocab * d_model
    return 6 * matmul + 12 * n_layer * n_head * hd * seq_len
