"""The collectives under test, their buffers, and the correctness check (nccl-tests' `-c`).

`build()` returns a `Case` with three closures: `run()` issues the collective once (what is timed),
`fill()` writes inputs that depend on the rank and the element position, and `wrong()` counts the
elements of this rank's result that differ from an expected result computed independently: every
rank regenerates all ranks' inputs locally and reduces them itself, so the check never trusts the
collective it checks.

torch.distributed has no out-of-place all_reduce / broadcast / reduce and no in-place
all_to_all / send-recv: those combinations are reported as N/A (`build` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from allreduce_bench.busbw import Layout, supports
from dtrain.run.dist import all_gather_single, reduce_scatter_single

REDUCE_OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "AVG"}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where expected results are computed: exact for the small integers the inputs hold."""
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if dtype.is_floating_point else torch.int64


def input_values(
    rank: int, numel: int, n: int, redop: str | None, dtype: torch.dtype, device
) -> torch.Tensor:
    """Rank- and position-dependent inputs, already rounded to `dtype` (returned in the acc dtype).

    Sums stay small integers (exact in bf16 up to n = 85); products have one 2 per position across
    ranks (exact in every format); max/min and data movement use a pattern that differs between
    ranks and along the buffer, so a misplaced chunk is caught."""
    pos = torch.arange(numel, device=device, dtype=torch.int64)
    if redop in ("sum", "avg"):
        v = (pos + 3 * rank) % 4
    elif redop == "prod":
        v = 1 + ((pos + rank) % n == 0).to(torch.int64)
    else:
        v = (37 * rank + 11 * pos) % 251
    return v.to(torch.float32).to(dtype).to(_acc_dtype(dtype))


def reduce_expected(
    rank_inputs: Callable[[int], torch.Tensor], n: int, redop: str, dtype: torch.dtype
) -> torch.Tensor:
    acc = rank_inputs(0).clone()
    for j in range(1, n):
        v = rank_inputs(j)
        if redop in ("sum", "avg"):
            acc += v
        elif redop == "prod":
            acc *= v
        elif redop == "max":
            acc = torch.maximum(acc, v)
        else:
            acc = torch.minimum(acc, v)
    if redop == "avg":
        acc = acc / n if acc.is_floating_point() else torch.div(acc, n, rounding_mode="trunc")
    return acc.to(dtype)


def count_wrong(result: torch.Tensor, expected: torch.Tensor, n: int, redop: str | None) -> int:
    """Elements outside tolerance; the tolerance is zero except where the backend may round
    differently from us (a floating sum/avg whose order of additions we do not control)."""
    acc = _acc_dtype(result.dtype)
    got, want = result.to(acc), expected.to(acc)
    if result.dtype.is_floating_point and redop in ("sum", "avg"):
        tol = torch.finfo(result.dtype).eps * (n + 1) * want.abs().clamp_min(1)
        ok = (got - want).abs() <= tol
    else:
        ok = got == want
    return int((~ok).sum())


@dataclass
class Case:
    collective: str
    in_place: bool
    run: Callable[[], None]
    fill: Callable[[], None]
    result: Callable[[], torch.Tensor | None]  # this rank's checked output (None: nothing to check)
    expected: Callable[[], torch.Tensor]


def build(
    collective: str,
    lay: Layout,
    dtype: torch.dtype,
    device,
    group,
    redop: str,
    root: int,
    in_place: bool,
    routing=None,
) -> Case | None:
    """Buffers and closures for one (collective, size, dtype, mode) on `group`; None when N/A."""
    if not supports(collective, in_place):
        return None
    r, n, m = dist.get_rank(group), lay.n, lay.chunk
    op = getattr(dist.ReduceOp, REDUCE_OPS[redop])
    red = redop if collective in ("all_reduce", "reduce_scatter", "reduce") else None
    vals = lambda rank, numel: input_values(rank, numel, n, red, dtype, device)  # noqa: E731
    new = lambda numel: torch.zeros(numel, dtype=dtype, device=device)  # noqa: E731
    send = new(lay.send_numel)

    if collective in ("all_reduce", "broadcast", "reduce"):
        src = dist.get_global_rank(group, root)
        run = {
            "all_reduce": lambda: dist.all_reduce(send, op=op, group=group),
            "broadcast": lambda: dist.broadcast(send, src=src, group=group),
            "reduce": lambda: dist.reduce(send, dst=src, op=op, group=group),
        }[collective]
        if collective == "broadcast":
            expected = lambda: vals(root, m).to(dtype)  # noqa: E731
        else:
            expected = lambda: reduce_expected(lambda j: vals(j, m), n, redop, dtype)  # noqa: E731
        checked = collective != "reduce" or r == root  # reduce leaves non-root buffers undefined
        return Case(
            collective,
            True,
            run,
            lambda: send.copy_(vals(r, m)),
            lambda: send if checked else None,
            expected,
        )

    if collective == "all_gather":
        recv = new(lay.recv_numel)
        inp = recv[r * m : (r + 1) * m] if in_place else send

        def fill():
            recv.zero_()
            inp.copy_(vals(r, m))

        expected = lambda: torch.cat([vals(j, m) for j in range(n)]).to(dtype)  # noqa: E731
        return Case(
            collective,
            in_place,
            lambda: all_gather_single(recv, inp, group=group),
            fill,
            lambda: recv,
            expected,
        )

    if collective == "reduce_scatter":
        out = send[r * m : (r + 1) * m] if in_place else new(lay.recv_numel)

        def expected():
            return reduce_expected(lambda j: vals(j, n * m)[r * m : (r + 1) * m], n, redop, dtype)

        return Case(
            collective,
            in_place,
            lambda: reduce_scatter_single(out, send, op=op, group=group),
            lambda: send.copy_(vals(r, n * m)),
            lambda: out,
            expected,
        )

    if collective == "all_to_all_v":  # uneven splits from a routing (alltoallv.py)
        from allreduce_bench import alltoallv

        elems = [alltoallv.splits(routing, lay, j)[0] for j in range(n)]  # every rank's sends
        ins, outs = elems[r], [elems[j][r] for j in range(n)]
        send, recv = new(sum(ins)), new(sum(outs))

        def expected():
            parts = []
            for j in range(n):
                start = sum(elems[j][:r])
                parts.append(vals(j, sum(elems[j]))[start : start + elems[j][r]])
            return torch.cat(parts).to(dtype)

        return Case(
            collective,
            False,
            lambda: dist.all_to_all_single(recv, send, outs, ins, group=group),
            lambda: send.copy_(vals(r, send.numel())),
            lambda: recv,
            expected,
        )

    recv = new(lay.recv_numel)
    if collective == "all_to_all":

        def expected():
            return torch.cat([vals(j, n * m)[r * m : (r + 1) * m] for j in range(n)]).to(dtype)

        return Case(
            collective,
            False,
            lambda: dist.all_to_all_single(recv, send, group=group),
            lambda: send.copy_(vals(r, n * m)),
            lambda: recv,
            expected,
        )

    if (
        collective == "sendrecv"
    ):  # nccl-tests' sendrecv: every rank sends to r+1 and receives from r-1
        nxt, prv = (
            dist.get_global_rank(group, (r + 1) % n),
            dist.get_global_rank(group, (r - 1) % n),
        )

        def run():
            ops = [
                dist.P2POp(dist.isend, send, nxt, group),
                dist.P2POp(dist.irecv, recv, prv, group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return Case(
            collective,
            False,
            run,
            lambda: send.copy_(vals(r, m)),
            lambda: recv,
            lambda: vals((r - 1) % n, m).to(dtype),
        )
    raise ValueError(f"unknown collective {collective!r}")


def check(case: Case, n: int, redop: str, corrupt: bool = False) -> int:
    """One fresh, checked execution: fill, run, compare. `corrupt` flips one result element first,
    to prove the check catches it (debug.inject_wrong)."""
    case.fill()
    case.run()
    result = case.result()
    if result is None:
        return 0
    if corrupt:  # -v-1 differs from v in every dtype, even after rounding
        first = result.view(-1)[:1]
        first.copy_((-first.to(torch.float32) - 1).to(first.dtype))
    red = redop if case.collective in ("all_reduce", "reduce_scatter", "reduce") else None
    return count_wrong(result, case.expected(), n, red)
