"""The benchmark's rank function: forward+backward of one TP layer, four ways.

    handrolled        TensorParallelBlock (or Attention) from attention.py
    handrolled_async  the same with the input-grad collective overlapped with the weight-grad GEMM
    dtensor           the same layouts through parallelize_module (dtrain.parallel.tp.dtensor_plan)
    single            the unsharded dtrain.model.gpt layer on rank 0 alone, with one rank's threads
                      (the guide's baseline) and, on CPU, with the whole TP group's threads

For each (tp, sequence_parallel) the first TP group (ranks 0..tp-1) measures while the other
ranks wait; one step is run under a CommCounter (counted bytes must equal the analytic ones)
and a few under torch.profiler, whose `tp_comm:*` ranges give the communication share.
"""

from __future__ import annotations

import contextlib
import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.model.gpt import Block
from dtrain.model.timing import synchronize, time_fn
from dtrain.parallel.tp import tp_collectives, dtensor_plan
from dtrain.parallel.tp.attention import (
    TensorParallelAttention,
    TensorParallelBlock,
    make_tp_groups,
)
from dtrain.parallel.tp.layers import allreduce_partial_grads
from dtrain.run.rank import RankContext
from tp_attention.config import as_list, model_config, torch_dtype, tp_degrees


def build_reference(cfg, device, dtype) -> torch.nn.Module:
    model_cfg = model_config(cfg)
    torch.manual_seed(cfg.seed)  # identical full weights on every rank
    block = Block(model_cfg, "blocks.0", lambda name, i, o, b: torch.nn.Linear(i, o, bias=b))
    block = block.to(device=device, dtype=dtype)
    return block if cfg.module == "block" else block.attn


def make_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, sync_grads: bool):
    """One forward+backward as in the middle of a network: input gradient and all weight grads."""

    def step():
        for p in module.parameters():
            p.grad = None
        inp = x.detach().requires_grad_()
        module(inp).backward(grad)
        if sync_grads:
            allreduce_partial_grads(module)

    return step


def comm_share(step, n_steps: int, device: torch.device) -> tuple[float, str]:
    """Communication time / step time over `n_steps` profiled steps, and the profile's op table.
    CPU (gloo): the wall time of the `tp_comm:*` ranges (blocking collectives, and the waits of
    async ones; waiting for a slower peer counts as communication). CUDA: the device time of
    NCCL kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    with _quiet_stderr():  # kineto prints a line at every start and stop
        prof.__enter__()
    for _ in range(n_steps):
        with record_function("tp_step"):
            step()
            synchronize(device)
    with _quiet_stderr():
        prof.__exit__(None, None, None)
    stats = prof.key_averages()
    step_us = sum(e.cpu_time_total for e in stats if e.key == "tp_step")
    if cuda:
        comm_us = sum(e.self_device_time_total for e in stats if "nccl" in e.key.lower())
    else:
        comm_us = sum(e.cpu_time_total for e in stats if e.key.startswith("tp_comm:"))
    table = stats.table(
        sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25
    )
    return (comm_us / step_us if step_us else float("nan")), table


@contextlib.contextmanager
def _quiet_stderr():
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Turns:
    """Lets some ranks measure while the others wait without burning a core: a rank blocked in a
    gloo collective busy-polls (measured here: a 1-thread GEMM on rank 0 ran ~2x slower while
    rank 1 sat in dist.barrier() on this 2-core host), so waiting ranks block on the
    rendezvous store instead, until rank 0 says the turn is over."""

    def __init__(self, timeout_s: float):
        self.turn, self.timeout = 0, timedelta(seconds=timeout_s)
        get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        self.store = get_store() if get_store else None

    def take(self, active: bool, leader: bool, fn):
        """`fn()` on the active ranks; the others wait until the leader (rank 0) finished it."""
        key, self.turn = f"tp_attention/turn/{self.turn}", self.turn + 1
        result = fn() if active else None
        if self.store is None:
            dist.barrier()
        elif leader:
            self.store.set(key, "done")
        elif not active:
            self.store.wait([key], self.timeout)
        return result


def _timed(step, cfg, device, group) -> dict:
    stats = time_fn(step, warmup=cfg.timing_warmup, iters=cfg.iters, device=device, barrier=group)
    return stats.to_dict()


def measure_tp(cfg, tp: int, sp: bool, groups, ref, x, g, device) -> dict:
    """Hand-rolled (sync and async), DTensor, comm volume and comm share on one TP group."""
    impls = as_list(cfg.impls)
    local = (lambda t: t.chunk(tp, 1)[groups.rank].contiguous()) if sp else (lambda t: t)
    xl, gl = local(x), local(g)
    cls = TensorParallelBlock if cfg.module == "block" else TensorParallelAttention
    out = {}
    hand = cls.from_full(ref, groups, sequence_parallel=sp, fused_qkv=cfg.train.fused_qkv)
    step = make_step(hand, xl, gl, sync_grads=True)
    out["handrolled"] = _timed(step, cfg, device, groups.group)
    with tp_collectives.CommCounter() as counter:
        step()
    out["counted"] = {
        tag: counter.wire_bytes(tag)
        for tag in (tp_collectives.ACTIVATION, tp_collectives.GRAD_SYNC)
    }
    out["payload_bytes"] = counter.payload_bytes()
    out["op_counts"] = counter.op_counts()
    out["comm_share"], out["profile_table"] = (
        comm_share(step, cfg.profile.steps, device) if tp > 1 else (0.0, "")
    )
    if "handrolled_async" in impls:
        hand_async = cls.from_full(
            ref,
            groups,
            sequence_parallel=sp,
            fused_qkv=cfg.train.fused_qkv,
            async_grad_allreduce=True,
        )
        step = make_step(hand_async, xl, gl, sync_grads=True)
        out["handrolled_async"] = _timed(step, cfg, device, groups.group)
        out["comm_share_async"] = comm_share(step, cfg.profile.steps, device)[0] if tp > 1 else 0.0
    if "dtensor" in impls and dtensor_plan.supported(model_config(cfg).n_kv_head, tp):
        from torch.distributed.tensor.debug import CommDebugMode

        dt = dtensor_plan.parallelize_block(copy.deepcopy(ref), dtensor_plan.tp_mesh(groups), sp)
        step = make_step(dt, xl, gl, sync_grads=False)
        out["dtensor"] = _timed(step, cfg, device, groups.group)
        with CommDebugMode() as mode:
            step()
        out["dtensor_collectives"] = mode.get_total_counts()
    return out


def measure_single(cfg, ref, x, g, device, threads: int | None) -> dict:
    """The unsharded layer in this process alone (the other ranks wait), with `threads` CPU
    threads."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        step = make_step(ref, x, g, sync_grads=False)
        return time_fn(step, warmup=cfg.timing_warmup, iters=cfg.iters, device=device).to_dict()
    finally:
        torch.set_num_threads(before)


def rank_fn(ctx: RankContext) -> dict:
    cfg, device = ctx.cfg, ctx.device
    dtype, m = torch_dtype(cfg), model_config(cfg)
    ref = build_reference(cfg, device, dtype)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.train.micro_batch, m.seq_len, m.d_model, generator=gen).to(device, dtype)
    g = torch.randn(cfg.train.micro_batch, m.seq_len, m.d_model, generator=gen).to(device, dtype)
    threads = torch.get_num_threads()
    single_cache: dict[int, dict] = {}
    entries = []
    combos = [(tp, sp) for tp in tp_degrees(cfg) for sp in as_list(cfg.train.sequence_parallel)]
    turns = Turns(cfg.dist_timeout_s)
    for tp, sp in progress(combos, ctx.is_main):
        groups = make_tp_groups(tp)  # collective: every rank, same order
        # The first TP group (ranks 0..tp-1) measures; then rank 0 alone runs the single baselines.
        measured = turns.take(
            groups is not None and ctx.rank < tp,
            ctx.is_main,
            lambda: measure_tp(cfg, tp, sp, groups, ref, x, g, device),
        )

        def singles():
            wanted = [threads] + ([tp * threads] if device.type == "cpu" and tp > 1 else [])
            for n in wanted:
                if n not in single_cache:
                    single_cache[n] = measure_single(
                        cfg, ref, x, g, device, n if device.type == "cpu" else None
                    )
            same = single_cache.get(tp * threads) if device.type == "cpu" else None
            entries.append(_entry(cfg, ctx, tp, sp, measured, single_cache[threads], same, threads))

        turns.take(ctx.is_main, ctx.is_main, singles)
        dist.barrier()
    return {
        "entries": entries,
        "device": device.type,
        "backend": ctx.backend,
        "gpu_name": ctx.gpu_name,
        "threads_per_rank": threads,
    }


def _entry(cfg, ctx, tp, sp, m, single, same_threads, threads) -> dict:
    elem_bytes, mc = torch.empty(0, dtype=torch_dtype(cfg)).element_size(), model_config(cfg)
    analytic = tp_collectives.expected_wire_bytes(
        batch=cfg.train.micro_batch,
        seq=mc.seq_len,
        d_model=mc.d_model,
        n_head=mc.n_head,
        n_kv_head=mc.n_kv_head,
        tp=tp,
        sequence_parallel=sp,
        module=cfg.module,
        norm=mc.norm,
        bias=mc.bias,
        elem_bytes=elem_bytes,
    )
    if analytic != m["counted"]:
        raise RuntimeError(
            f"tp={tp} sp={sp}: counted communication {m['counted']} != analytic {analytic}"
        )
    tokens = cfg.train.micro_batch * mc.seq_len
    e = {
        "tp": tp,
        "sequence_parallel": sp,
        "threads_per_rank": threads,
        "tokens": tokens,
        "comm_bytes_per_layer": analytic[tp_collectives.ACTIVATION],
        "grad_sync_bytes_per_layer": analytic[tp_collectives.GRAD_SYNC],
        "counted_bytes_per_layer": m["counted"][tp_collectives.ACTIVATION],
        "payload_bytes": m["payload_bytes"],
        "op_counts": m["op_counts"],
        "dtensor_collectives": m.get("dtensor_collectives"),
        "comm_share": m["comm_share"],
        "comm_share_async": m.get("comm_share_async"),
    }
    for impl in ("handrolled", "handrolled_async", "dtensor"):
        e[f"{impl}_s"] = m[impl]["median_s"] if impl in m else None
        if impl in m:  # TensorBoard: one curve per implementation and SP, tp on the x axis
            tag = f"step_time_s/{impl}/sp_{'on' if sp else 'off'}"
            ctx.writer.scalar(tag, m[impl]["median_s"], tp)
            ctx.writer.record(
                "step",
                impl=impl,
                tp=tp,
                sequence_parallel=sp,
                tokens_per_s=tokens / m[impl]["median_s"],
                **m[impl],
            )
    for name, stats, n in (
        ("single", single, threads),
        ("single_same_threads", same_threads, tp * threads),
    ):
        e[f"{name}_s"] = stats["median_s"] if stats else None
        if stats:
            ctx.writer.record(
                "step",
                impl=name,
                tp=tp,
                sequence_parallel=sp,
                threads=n,
                tokens_per_s=tokens / stats["median_s"],
                **stats,
            )
    ctx.writer.record(
        "comm",
        tp=tp,
        sequence_parallel=sp,
        analytic=analytic,
        counted=m["counted"],
        payload_bytes=m["payload_bytes"],
        op_counts=m["op_counts"],
        dtensor_collectives=m.get("dtensor_collectives"),
    )
    ctx.writer.record(
        "profile",
        tp=tp,
        sequence_parallel=sp,
        comm_share=m["comm_share"],
        comm_share_async=m.get("comm_share_async"),
    )
    if m["profile_table"]:  # where the hand-rolled step's time goes, op by op (rank 0)
        path = ctx.run_dir / f"profile_tp{tp}_sp{'on' if sp else 'off'}.txt"
        path.write_text(m["profile_table"] + "\n")
    return e


def progress(items, show: bool, desc: str = "tp x sp"):
    """A bar on a terminal (rank 0); in a pipe a line per setting (seconds to a minute each)."""
    from dtrain.core.terminal import bar

    return bar(items, desc=desc, show=show, lines=True)
