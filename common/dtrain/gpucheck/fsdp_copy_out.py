"""The bytes FSDP2 copies out of its weight all-gathers, counted from the ops it dispatches.

    python -m dtrain.gpucheck.fsdp_copy_out [--layers 2]

FSDP2 (``fully_shard``) gathers each unit's weights into one flat buffer and then copies them out
into the parameters' unsharded tensors on the compute stream (``foreach_all_gather_copy_out``:
``fsdp.split_with_sizes_copy``), which ``costmodel.eager.fsdp2_copy_out_s`` prices. This runs one
forward and backward of dtrain's GPT, every block and the root wrapped as the trainer wraps them
(bf16 parameters, fp32 reduction), on two gloo ranks (the CPU: no GPU needed; one rank gathers
nothing), and reports per unit how often its weights were copied out and the bytes each copy
wrote per parameter (a bf16 value each: 2; it reads as many).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
COPY_OUT_OP = "split_with_sizes_copy"  # in the fsdp namespace


class CopyOuts(TorchDispatchMode):
    """The output bytes of each FSDP2 copy-out dispatched inside it, by the numel it wrote."""

    def __init__(self):
        super().__init__()
        self.writes: list[tuple[int, int]] = []  # (elements, bytes) per call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "fsdp" and func.overloadpacket.__name__ == COPY_OUT_OP:
            dsts = (kwargs or {}).get("out") or args[-1]
            self.writes.append(
                (sum(t.numel() for t in dsts), sum(t.numel() * t.element_size() for t in dsts))
            )
        return out


def _rank(rank: int, layers: int, port: int, found: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dtrain.model.gpt import GPT, GPTConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=layers, n_head=4, d_model=64)
        model = GPT(cfg)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        unit = sum(p.numel() for p in model.blocks[0].parameters())  # global (DTensor) numel
        total = sum(p.numel() for p in model.parameters())
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        model(x, x).backward()  # lazy init outside the count
        with CopyOuts() as counted:
            model(x, x).backward()
        if rank == 0:
            found.update(
                block_params=unit,
                root_params=total - layers * unit,
                writes=counted.writes,
            )
    finally:
        dist.destroy_process_group()


def count(layers: int = 2) -> dict:
    """Per unit kind ("block", "root"): copy-outs in one forward and backward, bytes written per
    parameter per copy-out."""
    import torch.multiprocessing as mp

    from dtrain.run.dist import free_port

    with mp.Manager() as manager:
        found = manager.dict()
        mp.spawn(_rank, args=(layers, free_port(), found), nprocs=WORLD, join=True)
        found = dict(found)
    by = defaultdict(lambda: [0, 0])
    for numel, nbytes in found["writes"]:
        kind = "block" if numel == found["block_params"] else "root"
        by[kind][0] += 1
        by[kind][1] += nbytes / numel
    return {
        kind: {"copy_outs": n / (layers if kind == "block" else 1), "bytes_per_param": b / n}
        for kind, (n, b) in by.items()
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.fsdp_copy_out")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    print(json.dumps({"torch": torch.__version__, "world": WORLD, **count(args.layers)}, indent=2))


if __name__ == "__main__":
    main()
