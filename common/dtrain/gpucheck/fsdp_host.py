"""FSDP's host work per wrapped unit, against the plain eager step of the same model.

    python -m dtrain.gpucheck.fsdp_host [--layers 2 8] [--steps 20] [--fsdp 2|1]

The eager stack's host floor (``dtrain.costmodel.eager``) prices a step's host time as its kernel
launches x the host's seconds per launch. The trainer wraps each block and the root in FSDP2's
``fully_shard``; its pre/post forward and backward hooks (unshard, reshard, the all-gather's
copy-in and copy-out, the reduce-scatter's) are host work the plain step does not have. This probe
times one training step of dtrain's GPT at a width where the kernels cost next to nothing (d_model
64, 64 tokens), plain and under FSDP2 on one rank (gloo), at two depths: the difference's slope
over the wrapped units is FSDP2's host time per unit, reported in units of the plain step's host
time per modelled launch (``launch_equivalents``), which is how ``eager.yaml`` carries it to a
GPU host. Runs on the CPU (no GPU needed); medians of ``steps`` timed steps.

``--plain-autocast``: the plain step under bf16 autocast, as dtrain's trainer runs it without FSDP
(under FSDP2 it runs none): then the slope is what FSDP2's step costs the host over the trainer's
single-GPU step, autocast's per-op work netted out (the cost model's floor counts autocast's ops
for both, ``costmodel.eager``).

``--fsdp 1`` wraps the same units in FSDP1 (``FullyShardedDataParallel`` with a module wrap policy
on the blocks, ``use_orig_params``, the same bf16/fp32 mixed precision): one flat
parameter per unit, gathered and reduced whole, where FSDP2 copies each parameter in and out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _step_time(model, opt, x, steps: int, autocast: bool = False) -> float:
    def one():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(3):
        one()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(layers: int):
    from dtrain.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=layers, n_head=4, d_model=64)
    return cfg, GPT(cfg)


def _fsdp2(model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.blocks.children())
    for i, block in enumerate(blocks):  # as dtrain.train.parallelize.apply_fsdp wraps them
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    return fully_shard(model, mp_policy=policy)


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    block = type(next(model.blocks.children()))
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({block}),  # each block a unit, the root the rest
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )


def measure(layers: int, steps: int, fsdp: int = 2, plain_autocast: bool = False) -> dict:
    from dtrain.costmodel.eager import kernels_per_step
    from dtrain.costmodel.measured_cases import gpt_case_shape
    from dtrain.costmodel.shapes import Layout

    cfg, plain = _model(layers)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, foreach=True)
    t_plain = _step_time(plain, opt, x, steps, autocast=plain_autocast)
    model = (_fsdp2 if fsdp == 2 else _fsdp1)(_model(layers)[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    t_fsdp = _step_time(model, opt, x, steps)
    shape, structure = gpt_case_shape(cfg)
    launches = kernels_per_step(shape, Layout(), structure=structure)
    return {
        "layers": layers,
        "units": layers + 1,
        "plain_s": t_plain,
        "fsdp_s": t_fsdp,
        "launches": launches,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.gpucheck.fsdp_host")
    p.add_argument("--layers", type=int, nargs=2, default=[2, 8])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="FSDP2 or FSDP1")
    p.add_argument(
        "--plain-autocast",
        action="store_true",
        help="the plain step under bf16 autocast, as the trainer runs it without FSDP",
    )
    args = p.parse_args(argv)
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows = [measure(n, args.steps, args.fsdp, args.plain_autocast) for n in args.layers]
    finally:
        dist.destroy_process_group()
    lo, hi = rows
    per_unit = ((hi["fsdp_s"] - hi["plain_s"]) - (lo["fsdp_s"] - lo["plain_s"])) / (
        hi["units"] - lo["units"]
    )
    per_launch = (hi["plain_s"] - lo["plain_s"]) / (hi["launches"] - lo["launches"])
    out = {
        "device": "cpu",
        "torch": torch.__version__,
        "fsdp": args.fsdp,
        "plain": "autocast" if args.plain_autocast else "fp32",
        "rows": rows,
        "fsdp_host_s_per_unit": per_unit,
        "plain_host_s_per_launch": per_launch,
        "launch_equivalents": per_unit / per_launch,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
