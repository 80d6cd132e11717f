"""`python -m tp_attention.parity`: prove the hand-rolled TP equals the single-device model.

One launch checks many random cases in one process group (spawning is the slow part):

  ops     each conjugate operator's forward and backward against its definition
  layers  ColumnParallelLinear(gather_output) -> RowParallelLinear(scatter input) vs two nn.Linear
  cases   for every tp in `tp`, every head layout (MHA; GQA with kv_heads >= tp; kv_heads < tp)
          and SP off/on: a dtrain.model.gpt Block (or Attention) with random shapes, bias, norm and
          QKV variant (separate, fused, each with and without async grad all-reduce), sharded with
          from_full; output, input gradient and every parameter-shard gradient are compared with the
          reference's (sharded the same way), the collectives counted in the step are compared
          with tp_collectives.expected_wire_bytes, and where DTensor can shard the heads the DTensor
          baseline is checked the same way.

Errors are max|tp - ref| / max|ref| per tensor, the worst over ranks; rank 0 records each case.
Any error above `rtol`, or counted != analytic bytes, fails the run (exit 1, no summary.json).
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from dtrain.core.errors import UserError
from dtrain.model.gpt import Block, GPTConfig
from dtrain.parallel.tp import tp_collectives, dtensor_plan, ops
from dtrain.parallel.tp.attention import (
    TensorParallelAttention,
    TensorParallelBlock,
    make_tp_groups,
)
from dtrain.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_partial_grads,
)
from dtrain.run.app import hydra_main
from dtrain.run.rank import RankContext
from tp_attention.config import as_list, check_tp

VARIANTS = (
    {"fused_qkv": False},
    {"fused_qkv": True},
    {"fused_qkv": True, "async_grad_allreduce": True},
    {"fused_qkv": False, "async_grad_allreduce": True},
)


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """max|got - ref| / max|ref|, the denominator at least `floor` (see ZERO_GRAD_FLOOR)."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(floor))


# Some gradients are zero in exact arithmetic and hold only rounding noise: the key bias
# (softmax is invariant to adding q.b_k to every score of a query). Relative to noise any sum
# order "fails", so a gradient's scale is floored at this fraction of the case's largest one.
ZERO_GRAD_FLOOR = 1e-2


def _randn(seed: int, *shape, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def check_ops(groups, seed: int, device) -> dict[str, float]:
    """Every operator on per-rank inputs x_r and upstream grads g_r; each rank can rebuild every
    rank's tensors from the seed, so it knows what the forward and the backward must return."""
    n, r, cat = groups.tp, groups.rank, torch.cat
    B, T, H = 2, 2 * n, 3 * n
    xs = [_randn(seed + i, B, T, H, device=device) for i in range(n)]
    # name: (output shape, forward on rank r, input grad on rank r given every rank's g)
    spec = {
        "copy_to_region": ((B, T, H), xs[r], lambda g: sum(g)),
        "reduce_from_region": ((B, T, H), sum(xs), lambda g: g[r]),
        "gather_from_hidden": ((B, T, H * n), cat(xs, -1), lambda g: g[r].chunk(n, -1)[r]),
        "scatter_to_hidden": ((B, T, H // n), xs[r].chunk(n, -1)[r], lambda g: cat(g, -1)),
        "gather_from_sequence": ((B, T * n, H), cat(xs, 1), lambda g: sum(g).chunk(n, 1)[r]),
        "reduce_scatter_to_sequence": ((B, T // n, H), sum(xs).chunk(n, 1)[r], lambda g: cat(g, 1)),
        "scatter_to_sequence": ((B, T // n, H), xs[r].chunk(n, 1)[r], lambda g: cat(g, 1)),
    }
    errs = {}
    for k, (name, (shape, fwd, grad_of)) in enumerate(spec.items()):
        gs = [_randn(seed + 100 * (k + 1) + i, *shape, device=device) for i in range(n)]
        x = xs[r].clone().requires_grad_()
        y = getattr(ops, name)(x * 1, groups.group)  # x * 1: reduce_from_region sums in place
        y.backward(gs[r])
        errs[f"{name}.out"], errs[f"{name}.grad"] = rel_err(y, fwd), rel_err(x.grad, grad_of(gs))
    return errs


def check_layers(groups, seed: int, device) -> dict[str, float]:
    """Column(gather_output) then Row(input not parallel): the hidden-dim gather/scatter path."""
    n = groups.tp
    torch.manual_seed(seed)
    a, b = torch.nn.Linear(8, 4 * n).to(device), torch.nn.Linear(4 * n, 6).to(device)
    x = _randn(seed + 1, 3, 5, 8, device=device)
    g = _randn(seed + 2, 3, 5, 6, device=device)
    kw = dict(rank=groups.rank, tp=n, group=groups.group)
    col = ColumnParallelLinear.from_full(a.weight, a.bias, gather_output=True, **kw)
    row = RowParallelLinear.from_full(b.weight, b.bias, input_is_parallel=False, **kw)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = b(a(xr))
    ref.backward(g)
    out = row(col(xt))
    out.backward(g)
    shard = lambda t, dim: t.chunk(n, dim)[groups.rank]  # noqa: E731
    return {
        "layers.out": rel_err(out, ref),
        "layers.input_grad": rel_err(xt.grad, xr.grad),
        "layers.col_weight_grad": rel_err(col.weight.grad, shard(a.weight.grad, 0)),
        "layers.col_bias_grad": rel_err(col.bias.grad, shard(a.bias.grad, 0)),
        "layers.row_weight_grad": rel_err(row.weight.grad, shard(b.weight.grad, 1)),
        "layers.row_bias_grad": rel_err(row.bias.grad, b.bias.grad),
    }


def draw_case(rng: random.Random, tp: int, layout: str, sp: bool, index: int) -> dict:
    if layout == "mha":
        n_head = tp * rng.randint(1, 3)
        n_kv = n_head
    elif layout == "gqa_kv_ge_tp":
        n_kv = tp * rng.randint(1, 2)
        n_head = n_kv * rng.randint(2, 3)
    else:  # gqa_kv_lt_tp
        n_kv = rng.choice([k for k in range(1, tp) if tp % k == 0])
        n_head = tp * rng.randint(1, 2)
    head_dim = rng.choice([4, 8, 16])
    return dict(
        tp=tp,
        layout=layout,
        sequence_parallel=sp,
        n_head=n_head,
        n_kv_head=n_kv,
        d_model=n_head * head_dim,
        batch=rng.randint(1, 3),
        seq=tp * rng.randint(1, 5),
        bias=rng.random() < 0.5,
        norm=rng.choice(["rmsnorm", "layernorm"]),
        module=rng.choice(["block", "block", "attention"]),
        **VARIANTS[index % len(VARIANTS)],
    )


def build_reference(case: dict, seed: int, device) -> torch.nn.Module:
    cfg = GPTConfig(
        d_model=case["d_model"],
        n_head=case["n_head"],
        n_kv_head=case["n_kv_head"],
        bias=case["bias"],
        norm=case["norm"],
        seq_len=max(case["seq"], 1),
    )
    torch.manual_seed(seed)
    block = Block(cfg, "blocks.0", lambda name, i, o, b: torch.nn.Linear(i, o, bias=b)).to(device)
    with torch.no_grad():  # norms at weight 1 / bias 0 would hide a wrong norm-gradient sum
        for m in (block.attn_norm, block.mlp_norm):
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return block if case["module"] == "block" else block.attn


def shard_like(reference: torch.nn.Module, case: dict, groups) -> torch.nn.Module:
    kw = {k: case[k] for k in ("sequence_parallel", "fused_qkv") if k in case}
    kw["async_grad_allreduce"] = case.get("async_grad_allreduce", False)
    cls = TensorParallelBlock if case["module"] == "block" else TensorParallelAttention
    return cls.from_full(reference, groups, **kw)


def grads_as_module(reference: torch.nn.Module) -> torch.nn.Module:
    """A copy of the reference whose parameters hold its gradients: sharding it with from_full
    gives the expected gradient of every shard, laid out exactly like the TP parameters."""
    twin = copy.deepcopy(reference)
    for (_, p), (_, q) in zip(reference.named_parameters(), twin.named_parameters()):
        q.data, q.grad = p.grad.detach().clone(), None
    return twin


def check_case(case: dict, groups, seed: int, device) -> tuple[dict[str, float], dict[str, int]]:
    ref = build_reference(case, seed, device)
    B, T, D, n, r = case["batch"], case["seq"], case["d_model"], groups.tp, groups.rank
    x = _randn(seed + 1, B, T, D, device=device)
    g = _randn(seed + 2, B, T, D, device=device)
    local = (lambda t: t.chunk(n, 1)[r]) if case["sequence_parallel"] else (lambda t: t)
    tp_mod = shard_like(ref, case, groups)
    dt_mod = copy.deepcopy(ref) if dtensor_plan.supported(case["n_kv_head"], n) else None

    xr = x.clone().requires_grad_()
    ref_out = ref(xr)
    ref_out.backward(g)
    expected = dict(shard_like(grads_as_module(ref), case, groups).named_parameters())

    xt = local(x).clone().requires_grad_()
    with tp_collectives.CommCounter() as counter:
        out = tp_mod(xt)
        out.backward(local(g))
        allreduce_partial_grads(tp_mod)
    floor = ZERO_GRAD_FLOOR * max(float(p.grad.abs().max()) for p in ref.parameters())
    errs = {"out": rel_err(out, local(ref_out)), "input_grad": rel_err(xt.grad, local(xr.grad))}
    for name, p in tp_mod.named_parameters():
        errs[f"grad.{name}"] = rel_err(p.grad, expected[name], floor)
    if dt_mod is not None:
        dt_mod = dtensor_plan.parallelize_block(
            dt_mod, dtensor_plan.tp_mesh(groups), case["sequence_parallel"]
        )
        xd = local(x).clone().requires_grad_()
        dout = dt_mod(xd)
        dout.backward(local(g))
        errs["dtensor.out"] = rel_err(dout, local(ref_out))
        errs["dtensor.input_grad"] = rel_err(xd.grad, local(xr.grad))
        ref_grads = dict(ref.named_parameters())
        for name, p in dt_mod.named_parameters():
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            errs[f"dtensor.grad.{name}"] = rel_err(full, ref_grads[name].grad, floor)
    analytic = tp_collectives.expected_wire_bytes(
        **{
            k: case[k]
            for k in (
                "batch",
                "seq",
                "d_model",
                "n_head",
                "n_kv_head",
                "tp",
                "sequence_parallel",
                "module",
                "norm",
                "bias",
            )
        }
    )
    volume = {
        "analytic_activation": analytic[tp_collectives.ACTIVATION],
        "counted_activation": counter.wire_bytes(tp_collectives.ACTIVATION),
        "analytic_grad_sync": analytic[tp_collectives.GRAD_SYNC],
        "counted_grad_sync": counter.wire_bytes(tp_collectives.GRAD_SYNC),
    }
    return errs, volume


def _worst_over_ranks(errs: dict[str, float]) -> dict[str, float]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errs)
    names = sorted({k for e in everyone if e for k in e})
    return {k: max(e.get(k, 0.0) for e in everyone if e) for k in names}


def rank_fn(ctx: RankContext) -> dict:
    cfg, device = ctx.cfg, ctx.device
    rng = random.Random(cfg.seed)
    failures, n_checked, worst = [], 0, 0.0

    def report(kind: str, info: dict, errs: dict, volume: dict | None = None) -> None:
        nonlocal n_checked, worst
        errs = _worst_over_ranks(errs)
        bad = [f"{k}={v:.2e}" for k, v in errs.items() if not v <= cfg.rtol]
        if (
            volume
            and volume["analytic_activation"] + volume["analytic_grad_sync"]
            != volume["counted_activation"] + volume["counted_grad_sync"]
        ):
            bad.append(f"comm bytes analytic != counted: {volume}")
        if ctx.is_main:
            n_checked += len(errs)
            worst = max([worst, *errs.values()])
            ctx.writer.record(
                kind,
                **info,
                max_rel_err=max(errs.values(), default=0.0),
                errors=errs,
                **(volume or {}),
                passed=not bad,
            )
            if bad:
                failures.append(f"{kind} {info}: {', '.join(bad)}")

    for tp in as_list(cfg.train.tp):
        layouts = ["mha", "gqa_kv_ge_tp"] + (["gqa_kv_lt_tp"] if tp > 1 else [])
        groups = make_tp_groups(tp)
        seed = rng.randrange(1 << 30)
        report("ops", {"tp": tp}, check_ops(groups, seed, device) if groups else {})
        report("layers", {"tp": tp}, check_layers(groups, seed, device) if groups else {})
        for layout, sp in ((lay, sp) for lay in layouts for sp in (False, True)):
            for _ in range(cfg.cases_per_layout):
                case, seed = (
                    draw_case(rng, tp, layout, sp, rng.randrange(3)),
                    rng.randrange(1 << 30),
                )
                errs, volume = check_case(case, groups, seed, device) if groups else ({}, None)
                report("case", {**case, "seed": seed}, errs, volume)
    if ctx.is_main and failures:
        raise RuntimeError(f"parity failed in {len(failures)} check(s):\n" + "\n".join(failures))
    return {
        "checks": n_checked,
        "max_rel_err": worst,
        "rtol": cfg.rtol,
        "device": str(device),
        "backend": ctx.backend,
    }


def validate(cfg: DictConfig) -> None:
    for tp in as_list(cfg.train.tp):
        check_tp(tp, cfg.world_size)
    if not isinstance(cfg.cases_per_layout, int) or cfg.cases_per_layout < 1:
        raise UserError(f"cases_per_layout={cfg.cases_per_layout!r} must be an integer >= 1")


def finalize(run_dir, cfg, result) -> dict:
    print(
        f"parity: {result['checks']} tensors compared, worst relative error "
        f"{result['max_rel_err']:.2e} (rtol {result['rtol']:g});\n"  # two lines: 100 columns
        "        analytic == counted communication bytes in every case"
    )
    return {**result, "passed": True}


main = hydra_main(
    "tp_attention.conf", rank_fn=rank_fn, validate=validate, finalize=finalize, config_name="parity"
)

if __name__ == "__main__":
    main()
