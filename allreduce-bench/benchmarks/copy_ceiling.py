"""Memory-copy ceiling: how fast one device copies a buffer into another, the upper bound for any
collective that moves data through this device's memory (a one-rank NCCL all_gather or broadcast
is such a copy; NVLink busbw above it would be a measuring error).

    python allreduce-bench/benchmarks/copy_ceiling.py --device cuda  # device-to-device, CUDA events
    python allreduce-bench/benchmarks/copy_ceiling.py                # host memcpy, wall clock

Prints bytes/s of the copy (S/t, the busbw convention) and the memory traffic it implies (2S/t:
every byte is read once and written once, which is what CUDA's bandwidthTest reports for D2D).
"""

from __future__ import annotations

import argparse

import torch

from allreduce_bench.spec import parse_bytes, size_sweep
from dtrain.model.timing import Stopwatch, synchronize


def copy_seconds(nbytes: int, device: torch.device, warmup: int, iters: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    synchronize(device)
    watch = Stopwatch(device)
    watch.start()
    for _ in range(iters):
        dst.copy_(src)
    if device.type != "cuda":
        synchronize(device)
    return watch.stop() / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--max-bytes", default=None, help="default 1G on cuda, 256M on cpu")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "error: --device cuda but torch sees no CUDA GPU: run on a GPU node or drop --device"
        )
    top = parse_bytes(args.max_bytes or ("1G" if device.type == "cuda" else "256M"), "max")
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"# copy ceiling on {name}: dst.copy_(src), iters={args.iters}")
    print(f"#{'size (B)':>11}  {'time (us)':>10}  {'copy GB/s':>9}  {'traffic GB/s':>12}")
    best = 0.0
    for size in size_sweep(parse_bytes(args.min_bytes, "min"), top, args.factor):
        t = copy_seconds(size, device, args.warmup, args.iters)
        best = max(best, size / t / 1e9)
        print(f"{size:>12}  {t * 1e6:10.1f}  {size / t / 1e9:9.2f}  {2 * size / t / 1e9:12.2f}")
    print(f"# peak copy rate {best:.2f} GB/s (memory traffic {2 * best:.2f} GB/s)")


if __name__ == "__main__":
    main()
