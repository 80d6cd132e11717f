"""Benchmark of the benchmark: this tool's busbw vs a minimal raw torch.distributed loop.

    python allreduce-bench/benchmarks/overhead.py                       # 2 gloo ranks on CPU
    python allreduce-bench/benchmarks/overhead.py --device cuda --world-size 8 --max-bytes 1G

Both run in the same processes on the same sizes, interleaved round by round (ABBA order), so
drift and neighbours' load hit both alike. Each round gives one paired ratio, tool busbw / raw
busbw (= raw time / tool time, per-op times averaged over ranks); the median over rounds is the
answer, its interquartile range the noise. Goal: >= 0.98 at >= 1 MiB (the tool's closures,
barrier and bookkeeping cost <= 2%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import timeit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from allreduce_bench import busbw, collectives, sweep
from allreduce_bench.spec import DTYPES, parse_bytes, size_sweep, torch_dtype
from dtrain.model.timing import synchronize
from dtrain.run.dist import free_port


def raw_loop(x: torch.Tensor, warmup: int, iters: int, device) -> float:
    """The minimal loop a person would write: seconds per all_reduce on this rank."""
    for _ in range(warmup):
        dist.all_reduce(x)
    synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    synchronize(device)
    return (time.perf_counter() - t0) / iters


def tool_time(collective: str, lay, dtype, device, warmup: int, iters: int) -> float:
    """Exactly the path `python -m allreduce_bench` takes for one case (sweep.py)."""
    case = collectives.build(
        collective, lay, dtype, device, dist.group.WORLD, "sum", 0, in_place=True
    )
    seconds = sweep.time_per_op(case, warmup, iters, device)
    return sweep.over_ranks(seconds, True, 0, device)[0]


def closure_overhead_ns(calls: int = 200_000) -> float:
    """What the tool's timed loop adds per op, noise-free: its ops are closures with keyword
    arguments (collectives.build) where the raw loop calls dist.all_reduce(x) directly. Timed on a
    stub that does nothing, so only the Python call overhead remains."""
    stub = lambda *a, **k: None  # noqa: E731
    x, op, group = object(), object(), object()
    run = lambda: stub(x, op=op, group=group)  # noqa: E731  (the shape of Case.run)
    best = {}
    for name, loop in (
        ("raw", lambda: [stub(x) for _ in range(calls)]),
        ("tool", lambda: [run() for _ in range(calls)]),
    ):
        best[name] = min(timeit.repeat(loop, number=1, repeat=5)) / calls
    return (best["tool"] - best["raw"]) * 1e9


def avg_over_ranks(seconds: float, device) -> float:
    t = torch.tensor(
        [seconds], dtype=torch.float64, device=device if device.type == "cuda" else "cpu"
    )
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def worker(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.world_size
    )
    dtype, n = torch_dtype(args.dtype), args.world_size
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for size in size_sweep(
        parse_bytes(args.min_bytes, "min"), parse_bytes(args.max_bytes, "max"), args.factor
    ):
        lay = busbw.layout("all_reduce", size, elem, n)
        x = torch.ones(lay.count, dtype=dtype, device=device)
        tool, raw = [], []
        for r in range(args.rounds):  # ABBA: alternate which side goes first
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for side in order:
                if side == 0:
                    tool.append(
                        tool_time("all_reduce", lay, dtype, device, args.warmup, args.iters)
                    )
                else:
                    raw.append(avg_over_ranks(raw_loop(x, args.warmup, args.iters, device), device))
        t_tool, t_raw = statistics.median(tool), statistics.median(raw)
        paired = sorted(r / t for r, t in zip(raw, tool))  # each round's two sides ran back to back
        q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
        rows.append(
            (
                lay.nbytes,
                busbw.busbw_GBps("all_reduce", lay.nbytes, t_tool, n),
                busbw.busbw_GBps("all_reduce", lay.nbytes, t_raw, n),
                statistics.median(paired),
                q1,
                q3,
            )
        )
    if rank == 0:
        print(
            f"# all_reduce {args.dtype}, {n} ranks ({device.type}), iters={args.iters} "
            f"warmup={args.warmup}, median of {args.rounds} interleaved rounds"
        )
        print(
            "# busbw (GB/s) from each side's median time; ratio = tool busbw / raw busbw, the "
            "median over rounds of the paired ratio (both sides of a round ran back to back), "
            "with its interquartile range"
        )
        print(
            f"#{'size (B)':>11}  {'tool busbw':>10}  {'raw busbw':>10}  {'ratio':>6}  {'IQR':>13}"
        )
        for nbytes, b_tool, b_raw, ratio, q1, q3 in rows:
            print(f"{nbytes:>12}  {b_tool:10.4f}  {b_raw:10.4f}  {ratio:6.3f}  {q1:6.3f}-{q3:6.3f}")
        big = [
            (r, nb * busbw.bus_factor("all_reduce", n) / (bt * 1e9))
            for nb, bt, _, r, _, _ in rows
            if nb >= 2**20
        ]
        if big:
            print(
                f"# sizes >= 1 MiB: median paired ratio {', '.join(f'{r:.3f}' for r, _ in big)} "
                f"({'meets' if min(r for r, _ in big) >= 0.98 else 'misses'} the >= 0.98 goal)"
            )
            extra, fastest = closure_overhead_ns(), min(t for _, t in big)
            print(
                f"# the only code the tool adds inside the timed loop costs {extra:.0f} ns per op "
                f"= {100 * extra * 1e-9 / fastest:.4f}% of the fastest op >= 1 MiB here "
                f"({fastest * 1e6:.0f} us); ratio bound from it: "
                f"{1 / (1 + extra * 1e-9 / fastest):.5f}"
            )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--min-bytes", default="256K")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    mp.start_processes(
        worker, args=(args, free_port()), nprocs=args.world_size, start_method="spawn"
    )


if __name__ == "__main__":
    main()
