"""The uneven all-to-all (``all_to_all_v``): expert parallelism's dispatch, with a routing skew.

Every rank holds ``tokens`` tokens and sends each to ``top_k`` distinct experts (top-k
duplication: a token goes once per expert, DeepEP's per-node deduplication is not modelled);
``experts_per_rank`` experts live on each rank, expert e on rank e // experts_per_rank. The experts
are drawn from one distribution, the routing ``skew``:

    uniform   every expert alike
    zipf      p_e ~ 1 / (e + 1)^zipf_s (expert 0 hottest, so the first rank's experts are)
    hot       one hot expert (expert 0) with probability hot_share, the rest alike

Each rank draws its tokens' experts from its own seeded generator (``seed``, rank), so every rank
can recompute the whole send matrix (rows[i][j]: rows rank i sends rank j) without a collective.
At message size S each rank's buffer (S rounded down to whole elements) is apportioned over the
ranks as its rows are (largest remainders): the pattern is the same at every size, so the α–β fit
over sizes is the pattern's.

S counted (nccl-tests' all-to-all convention) is the per-rank send buffer, the same on every rank;
busbw = algbw * (n-1)/n. ``imbalance`` is the busiest rank's max(rows sent, rows received) over the
balanced count tokens * top_k: the ρ the cost model's uneven all-to-all scales with.

Torch is imported where the routing is drawn: the command-line check reads ``Routing`` without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from allreduce_bench.busbw import Layout

SKEWS = ("uniform", "zipf", "hot")


@dataclass(frozen=True)
class Routing:
    skew: str = "uniform"
    top_k: int = 2
    experts_per_rank: int = 4
    tokens: int = 256
    zipf_s: float = 1.2
    hot_share: float = 0.5
    seed: int = 0


def expert_probs(routing: Routing, experts: int):
    import torch  # spec.py reads Routing without torch

    if routing.skew == "zipf":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** routing.zipf_s
    elif routing.skew == "hot":
        p = torch.full(
            (experts,), (1 - routing.hot_share) / max(experts - 1, 1), dtype=torch.float64
        )
        p[0] = routing.hot_share
    else:
        p = torch.ones(experts, dtype=torch.float64)
    return p / p.sum()


def rows_from(routing: Routing, n: int, rank: int) -> list[int]:
    """Rows ``rank`` sends each of the n ranks: its tokens' top_k experts, drawn without
    replacement."""
    import torch

    g = torch.Generator().manual_seed(routing.seed * 1_000_003 + rank)
    p = expert_probs(routing, n * routing.experts_per_rank)
    idx = torch.multinomial(p.expand(routing.tokens, -1), routing.top_k, generator=g)
    return torch.bincount((idx // routing.experts_per_rank).flatten(), minlength=n).tolist()


def send_matrix(routing: Routing, n: int) -> list[list[int]]:
    return [rows_from(routing, n, i) for i in range(n)]


def imbalance(rows: list[list[int]]) -> float:
    """The busiest rank's max(sent, received) rows over the balanced tokens * top_k."""
    n = len(rows)
    sent = [sum(r) for r in rows]
    received = [sum(rows[i][j] for i in range(n)) for j in range(n)]
    return max(max(sent), max(received)) / (sum(sent) / n)


def apportion(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, whole numbers summing to it (largest
    remainders first, ties to the lower index)."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (out[i] - exact[i], i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def layout(requested_bytes: int, elem_size: int, n: int) -> Layout:
    """S rounded down to whole elements (at least one), as the even all-to-all's buffer."""
    count = max(1, requested_bytes // elem_size)
    return Layout("all_to_all_v", n, elem_size, count, count, count)


def splits(routing: Routing, lay: Layout, rank: int) -> tuple[list[int], list[int]]:
    """(input splits, output splits) in elements for ``rank``: every rank's buffer of lay.count
    elements apportioned over the ranks as its rows are."""
    elems = [apportion(lay.count, row) for row in send_matrix(routing, lay.n)]
    return elems[rank], [elems[i][rank] for i in range(lay.n)]
