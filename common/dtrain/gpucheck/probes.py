"""Two probes of `make gpu-check` that test the cost model's compute and overlap terms on one GPU:

    python -m dtrain.gpucheck.probes layer_probe | contention [--small]

layer_probe   one transformer block of a published model at its TP shard, timed against the cost
              model's price of the same block (dtrain.gpucheck.layer_probe)
contention    what a transfer running beside compute costs: the share of it the overlap did not
              hide (dtrain.gpucheck.contention)

`--small` runs the layer probe at CPU sizes in fp32 without compile (the tests); contention needs
CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dtrain.gpucheck.contention import contention
from dtrain.gpucheck.layer_probe import layer_probe

PROBES = {"layer_probe": layer_probe, "contention": contention}


def _micro_batches(text: str) -> tuple[int, ...]:
    """--micro-batches: positive integers, comma-separated (1,2,3)."""
    try:
        mbs = tuple(int(m) for m in text.split(","))
    except ValueError:
        mbs = ()
    if not mbs or min(mbs) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive micro-batches (1,2,3)"
        )
    return mbs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.probes")
    p.add_argument("name", choices=sorted(PROBES))
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (tests)")
    p.add_argument(
        "--micro-batches",
        type=_micro_batches,
        default=(),
        help="layer_probe: comma-separated micro-batches (default: each case's own)",
    )
    args = p.parse_args(argv)
    if not (
        args.small or torch.cuda.is_available()
    ):  # the published shapes would run for hours on a CPU
        print(
            f"error: {args.name} needs a CUDA GPU (torch here sees none): run it on one, or pass "
            "--small for the CPU test sizes",
            file=sys.stderr,
        )
        raise SystemExit(2)
    kwargs = {"micro_batches": args.micro_batches} if args.name == "layer_probe" else {}
    print(json.dumps(PROBES[args.name](small=args.small, **kwargs)), flush=True)


if __name__ == "__main__":
    main()
