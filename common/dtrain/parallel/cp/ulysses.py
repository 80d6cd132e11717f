"""All-to-all ("Ulysses") context parallelism: swap the sequence shard for a head shard, attend
over the whole sequence, swap back.

    (B, H, s/cp, hd) per rank --all-to-all--> (B, H/cp, s, hd) --causal SDPA--> --all-to-all--> (B,
    H, s/cp, hd)

Four all-to-alls forward (q, k, v, out) and four backward, each moving (cp-1)/cp of a rank's
tensor: the volume does not grow with cp, unlike the ring's, but cp must divide the heads.
The gathered sequence arrives in shard order (rank 0's zigzag chunks, then rank 1's, ...):
it is put in position order for the causal mask and back. GQA: k/v heads are repeated up to a
multiple of cp when cp does not divide them (`exchange.ulysses_kv_heads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.parallel.comm_counter import group_size
from dtrain.parallel.cp import exchange, sharding


def causal_sdpa(q, k, v) -> torch.Tensor:
    """Causal SDPA on (B, heads, s, hd) with fewer k/v heads (GQA), as dtrain.model.gpt does it."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard (shapes as ring.ring_attention); cp must
    divide the query heads."""
    cp = group_size(group)
    if cp == 1:
        return causal_sdpa(q, k, v)
    heads = exchange.ulysses_kv_heads(k.shape[1], cp)
    if heads != k.shape[1]:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (exchange.all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    order = sharding.shard_order(q.shape[2], cp, q.device)  # position of each gathered token
    to_positions = torch.argsort(order)
    y = causal_sdpa(*(t.index_select(2, to_positions) for t in (q, k, v)))
    return exchange.all_to_all(y.index_select(2, order), group, scatter_dim=2, gather_dim=1)
