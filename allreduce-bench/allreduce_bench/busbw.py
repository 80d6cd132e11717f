"""Bytes counted, algorithm bandwidth and bus bandwidth, exactly as NVIDIA's nccl-tests define them.

    algbw = S / t            S: the bytes nccl-tests counts for the collective (below)
    busbw = algbw * c(n)     c: the bus factor, so busbw is comparable to the link's speed

| collective     | S (bytes counted)                | c(n)     | per-rank buffers (elements)
|----------------|----------------------------------|----------|-----------------------------------
| all_reduce     | the per-rank buffer              | 2(n-1)/n | in = out = S/w
| all_gather     | the whole output                 | (n-1)/n  | in = S/(n w), out = S/w
| reduce_scatter | the whole input                  | (n-1)/n  | in = S/w, out = S/(n w)
| all_to_all     | the per-rank send buffer         | (n-1)/n  | in = out = S/w, n chunks of S/(n w)
| all_to_all_v   | the per-rank send buffer         | (n-1)/n  | in = S/w, uneven (alltoallv.py)
| broadcast      | the buffer                       | 1        | S/w
| reduce         | the buffer                       | 1        | S/w
| sendrecv       | the buffer sent to the next rank | 1        | S/w

(w: bytes per element.) The derivation is in the README: a ring all-reduce sends and receives
2(n-1)/n * S per rank, all-gather/reduce-scatter/all-to-all (n-1)/n * S, so t >= S*c/B_link and
busbw = S*c/t is at most the link bandwidth whatever n is. This is also why the α–β fit in
`fit.py` uses x = S*c: its β is a bus bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_v",
    "sendrecv",
)
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")  # S is split into n per-rank chunks
# torch.distributed has one form of these (collectives.py runs the other only where it exists)
IN_PLACE_ONLY = ("all_reduce", "broadcast", "reduce")
OUT_OF_PLACE_ONLY = ("all_to_all", "all_to_all_v", "sendrecv")


def supports(collective: str, in_place: bool) -> bool:
    """Whether torch.distributed has `collective` in place (or out of place)."""
    return not (collective in IN_PLACE_ONLY and not in_place) and not (
        collective in OUT_OF_PLACE_ONLY and in_place
    )


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor c(n): busbw = algbw * c(n)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in (*CHUNKED, "all_to_all_v"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


@dataclass(frozen=True)
class Layout:
    """Buffer sizes of one case. `nbytes` is S, the bytes counted (a multiple of n*w for chunked
    ops)."""

    collective: str
    n: int
    elem_size: int
    chunk: int  # elements per rank-chunk (CHUNKED) or the whole buffer (others)
    send_numel: int
    recv_numel: int

    @property
    def count(self) -> int:
        """Elements of the counted buffer: nccl-tests' `count` column."""
        return max(self.send_numel, self.recv_numel)

    @property
    def nbytes(self) -> int:
        return self.count * self.elem_size


def layout(collective: str, requested_bytes: int, elem_size: int, n: int) -> Layout:
    """Round S down to whole elements (and whole chunks, like nccl-tests), at least one element."""
    bus_factor(collective, n)  # validates the name
    if collective in CHUNKED:
        chunk = max(1, requested_bytes // (n * elem_size))
        whole, part = chunk * n, chunk
        if collective == "all_gather":
            return Layout(collective, n, elem_size, chunk, part, whole)
        if collective == "reduce_scatter":
            return Layout(collective, n, elem_size, chunk, whole, part)
        return Layout(collective, n, elem_size, chunk, whole, whole)
    count = max(1, requested_bytes // elem_size)
    return Layout(collective, n, elem_size, count, count, count)


def algbw_GBps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def busbw_GBps(collective: str, nbytes: int, seconds: float, n: int) -> float:
    return algbw_GBps(nbytes, seconds) * bus_factor(collective, n)
