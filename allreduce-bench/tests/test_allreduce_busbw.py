"""Byte counts and bus factors against hand-computed nccl-tests values, for n = 2, 4, 8."""

import pytest

from allreduce_bench import busbw

MiB = 2**20


@pytest.mark.parametrize(
    "n, all_reduce, chunked", [(2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)]
)
def test_bus_factors(n, all_reduce, chunked):
    assert busbw.bus_factor("all_reduce", n) == all_reduce
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert busbw.bus_factor(c, n) == chunked
    for c in ("broadcast", "reduce", "sendrecv"):
        assert busbw.bus_factor(c, n) == 1.0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bytes_counted_per_collective(n):
    w = 4  # float32
    # all_reduce, broadcast, reduce, sendrecv: the per-rank buffer of S bytes
    for c in ("all_reduce", "broadcast", "reduce", "sendrecv"):
        lay = busbw.layout(c, MiB, w, n)
        assert (lay.send_numel, lay.recv_numel, lay.count, lay.nbytes) == (
            MiB // 4,
            MiB // 4,
            MiB // 4,
            MiB,
        )
    # all_gather: S is the whole output; each rank sends S/n
    ag = busbw.layout("all_gather", MiB, w, n)
    assert (ag.send_numel, ag.recv_numel, ag.nbytes) == (MiB // 4 // n, MiB // 4, MiB)
    # reduce_scatter: S is the whole input; each rank receives S/n
    rs = busbw.layout("reduce_scatter", MiB, w, n)
    assert (rs.send_numel, rs.recv_numel, rs.nbytes) == (MiB // 4, MiB // 4 // n, MiB)
    # all_to_all: S is the per-rank send buffer, n chunks of S/n
    a2a = busbw.layout("all_to_all", MiB, w, n)
    assert (a2a.send_numel, a2a.recv_numel, a2a.chunk, a2a.nbytes) == (
        MiB // 4,
        MiB // 4,
        MiB // 4 // n,
        MiB,
    )


def test_chunked_sizes_round_down_to_whole_chunks_like_nccl_tests():
    lay = busbw.layout("all_gather", 1000, 4, 8)  # 1000 B over 8 ranks of fp32: 31 elements each
    assert (lay.chunk, lay.nbytes) == (31, 31 * 8 * 4)
    assert busbw.layout("all_reduce", 1001, 2, 8).nbytes == 1000  # whole bf16 elements
    assert busbw.layout("all_to_all", 4, 4, 8).chunk == 1  # never empty


@pytest.mark.parametrize("n, expected", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_algbw_and_busbw(n, expected):
    assert busbw.algbw_GBps(10**9, 1.0) == 1.0
    assert busbw.busbw_GBps("all_reduce", 10**9, 1.0, n) == pytest.approx(expected)
    assert busbw.busbw_GBps("all_gather", 2 * 10**9, 0.5, n) == pytest.approx(4 * (n - 1) / n)


def test_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        busbw.bus_factor("allreduce", 2)
