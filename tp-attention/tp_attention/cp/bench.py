"""The CP study's rank function: forward+backward of one attention layer over a sequence shared by
cp ranks, per sequence length and cp degree, against one device and TP with SP at tp = cp.

    single   the dtrain.model.gpt Attention on the whole sequence, rank 0 alone (one rank's threads)
    ring     ring attention (dtrain.parallel.cp.ring), sends overlapped with the block compute;
             also `serial` (each send waited first) and `sends` (the same sends, no compute):
             overlap_fraction = (serial - ring) / sends, clipped to [0, 1]
    ulysses  all-to-all attention (dtrain.parallel.cp.ulysses)
    tp_sp    TensorParallelAttention with sequence parallelism, tp = cp (dtrain.parallel.tp)

The first cp ranks measure while the others wait (bench.Turns). Every measured CP layer is first
checked against one device (parity.check_case: output and every gradient within rtol, counted
bytes = analytic), so a timing is never published for a wrong layer. Memory: the bytes autograd
saves for backward (activations, parameters left out), per rank; on CUDA also the peak allocated.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dtrain.core import nodes as dtrain_config
from dtrain.model.timing import synchronize, time_fn
from dtrain.parallel.cp import exchange
from dtrain.parallel.cp import sharding
from dtrain.parallel.cp.trainer_cp import ContextParallelCore
from dtrain.parallel.tp.attention import TensorParallelAttention, make_tp_groups
from dtrain.run.rank import RankContext
from tp_attention.bench import Turns, progress
from tp_attention.config import as_list, torch_dtype
from tp_attention.cp.parity import build_reference, check_case, failures


def seq_lens(cfg) -> list[int]:
    return as_list(cfg.model.seq_len)


def cp_degrees(cfg) -> list[int]:
    return [cfg.world_size] if cfg.train.cp is None else as_list(cfg.train.cp)


def model_at(cfg, seq_len: int):
    """The GPTConfig of the model node at one of its sequence lengths."""
    from omegaconf import OmegaConf

    node = (
        OmegaConf.to_container(cfg.model, resolve=True)
        if OmegaConf.is_config(cfg.model)
        else dict(cfg.model)
    )
    return dtrain_config.model_config({**node, "seq_len": seq_len})


def saved_bytes(step, params) -> int:
    """Bytes of the tensors autograd keeps for backward during `step()`, each storage once,
    parameters left out."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(kept.values())


def peak_bytes(step, device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def make_step(module, x, g):
    def step():
        for p in module.parameters():
            p.grad = None
        module(x.detach().requires_grad_()).backward(g)

    return step


def measure(name: str, step, module, cfg, device, group) -> dict:
    stats = time_fn(
        step, warmup=cfg.timing_warmup, iters=cfg.iters, device=device, barrier=group
    ).to_dict()
    return {
        "impl": name,
        **stats,
        "saved_bytes": saved_bytes(step, list(module.parameters())),
        "peak_bytes": peak_bytes(step, device),
    }


def sends_alone(block: torch.Tensor, count: int, group):
    """The ring's sends without its compute: `count` exchanges of one k/v block, one after
    another."""

    def step():
        for _ in range(count):
            exchange.ring_exchange(block, group, exchange.KV).wait()

    return step


def measure_cp(cfg, seq_len: int, cp: int, groups, ref, x, g, device) -> list[dict]:
    """Every CP implementation (and TP+SP) of `ref` at one (seq_len, cp), on this rank of the
    group."""
    rank, group, out = groups.rank, groups.group, []
    m = model_at(cfg, seq_len)
    xl, gl = sharding.shard(x, cp, rank), sharding.shard(g, cp, rank)
    for impl in as_list(cfg.train.cp_impl):
        case = dict(
            impl=impl,
            cp=cp,
            n_head=m.n_head,
            n_kv_head=m.n_kv_head,
            head_dim=m.head_dim,
            batch=cfg.train.micro_batch,
            seq=seq_len,
            bias=m.bias,
        )
        errs, volume = check_case(case, group, cfg.seed, device, ref=ref)
        bad = failures(_worst(errs, group, device), volume, cfg.rtol)
        if bad:
            raise RuntimeError(
                f"cp={cp} {impl} seq_len={seq_len}: not equal to one device: {', '.join(bad)}"
            )
        layer = copy.deepcopy(ref)
        layer.core = ContextParallelCore(impl, group)
        row = {
            **measure(impl, make_step(layer, xl, gl), layer, cfg, device, group),
            "comm_bytes_per_layer": volume["analytic"],
            "max_rel_err": max(errs.values()),
        }
        if impl == "ring":
            layer.core = ContextParallelCore(impl, group, overlap=False)
            timed = dict(warmup=cfg.timing_warmup, iters=cfg.iters, device=device, barrier=group)
            row["serial_s"] = time_fn(make_step(layer, xl, gl), **timed).median
            kv = xl.new_empty(
                2, x.shape[0], m.n_kv_head, seq_len // cp, m.head_dim
            )  # one k/v block
            row["sends_s"] = time_fn(sends_alone(kv, 3 * (cp - 1), group), **timed).median
            hidden = (
                (row["serial_s"] - row["median_s"]) / row["sends_s"] if row["sends_s"] > 0 else 0.0
            )
            row["overlap_fraction"] = min(1.0, max(0.0, hidden))
        out.append(row)
    if cfg.tp_sp and _tp_can_split(m, cp):
        tp_layer = TensorParallelAttention.from_full(ref, groups, sequence_parallel=True)

        def chunk(t):  # SP: contiguous sequence slices
            return t.chunk(cp, 1)[rank].contiguous()

        row = measure(
            "tp_sp", make_step(tp_layer, chunk(x), chunk(g)), tp_layer, cfg, device, group
        )
        out.append(row)
    return out


def _tp_can_split(m, tp: int) -> bool:
    from dtrain.core.errors import UserError
    from dtrain.parallel.feasibility import check_tp_heads

    try:
        check_tp_heads(m.n_head, m.n_kv_head, tp)
    except UserError:
        return False
    return m.seq_len % tp == 0


def _worst(errs: dict[str, float], group, device) -> dict[str, float]:
    """The worst error of each tensor over the cp ranks."""
    t = torch.tensor(list(errs.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(errs, t.tolist()))


def rank_fn(ctx: RankContext) -> dict:
    cfg, device = ctx.cfg, ctx.device
    dtype = torch_dtype(cfg)
    turns, rows = Turns(cfg.dist_timeout_s), []
    combos = [(s, cp) for s in seq_lens(cfg) for cp in cp_degrees(cfg)]
    singles: dict[int, dict] = {}
    for seq_len, cp in progress(combos, ctx.is_main, "seq_len x cp"):
        m = model_at(cfg, seq_len)
        ref = build_reference(
            {
                "n_head": m.n_head,
                "n_kv_head": m.n_kv_head,
                "head_dim": m.head_dim,
                "bias": m.bias,
                "seq": seq_len,
            },
            cfg.seed,
            device,
            dtype,
        )
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        x = torch.randn(cfg.train.micro_batch, seq_len, m.d_model, generator=gen).to(device, dtype)
        g = torch.randn(cfg.train.micro_batch, seq_len, m.d_model, generator=gen).to(device, dtype)
        groups = make_tp_groups(
            cp
        )  # collective: consecutive blocks of cp ranks; the first one measures
        measured = turns.take(
            groups is not None and ctx.rank < cp,
            ctx.is_main,
            lambda: measure_cp(cfg, seq_len, cp, groups, ref, x, g, device),
        )
        if seq_len not in singles:
            singles[seq_len] = (
                turns.take(
                    ctx.is_main,
                    ctx.is_main,
                    lambda: measure("single", make_step(ref, x, g), ref, cfg, device, None),
                )
                or {}
            )
        for row in measured or []:
            if ctx.is_main:
                row = {**row, "seq_len": seq_len, "cp": cp}
                ctx.writer.record("cp_step", **row)
                rows.append(row)
        if ctx.is_main:
            single = {**singles[seq_len], "seq_len": seq_len, "cp": 1}
            if not any(r["impl"] == "single" and r["seq_len"] == seq_len for r in rows):
                ctx.writer.record("cp_step", **single)
                rows.append(single)
        dist.barrier()
    return {
        "rows": rows,
        "device": device.type,
        "backend": ctx.backend,
        "gpu_name": ctx.gpu_name,
        "threads_per_rank": torch.get_num_threads(),
    }
