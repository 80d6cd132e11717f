"""Load-balanced ("zigzag") sequence sharding for causal context parallelism.

Cut the sequence into 2·cp equal chunks; rank r holds chunks r and 2cp−1−r, in that order:

    cp = 2, 8 tokens:   chunks [0 1][2 3][4 5][6 7]   rank 0: [0 1 6 7]   rank 1: [2 3 4 5]

Under a causal mask the early chunks attend to little and the late ones to much, so pairing chunk r
with its mirror gives every rank the same work (ring.py counts it). PyTorch's context_parallel
(`_HeadTailLoadBalancer`) uses this same layout, so the trainer's batches are the same either way.
"""

from __future__ import annotations

import torch


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) rank `rank` holds, earliest first."""
    return rank, 2 * cp - 1 - rank


def check_divisible(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")


def positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global token positions this rank holds, (seq_len / cp,) int64, increasing."""
    check_divisible(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (a view-free copy along `dim`)."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, x.device))


def shard_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the concatenation of every rank's shard, rank 0 first: what an
    all-gather along the sequence (ulysses.py) returns, position by position."""
    return torch.cat([positions(seq_len, cp, r, device) for r in range(cp)])


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (rank order), tokens back in their places."""
    cp = len(shards)
    gathered = torch.cat(shards, dim)
    order = shard_order(gathered.shape[dim], cp, gathered.device)
    return gathered.index_select(dim, torch.argsort(order))
