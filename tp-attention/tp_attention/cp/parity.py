"""Context-parallel attention == one device: the check every CP study run and test makes.

`check_case` builds a dtrain.model.gpt Attention, runs it on the whole sequence (the reference),
then gives a copy the context-parallel core (ring or all-to-all, `dtrain.parallel.cp`) and runs it
on
this rank's zigzag shard of the same input. Compared, as max|cp - ref| / max|ref| per tensor:
the output shard, the input-gradient shard and every weight gradient (each cp rank holds the
weights whole and computes the gradient of its own tokens: summed over the cp group it is the
full one). The collectives counted during the step must equal `cp.comm.expected_wire_bytes`.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist

from dtrain.model.gpt import Block, GPTConfig
from dtrain.parallel.comm_counter import CommCounter
from dtrain.parallel.cp import exchange
from dtrain.parallel.cp import sharding
from dtrain.parallel.cp.trainer_cp import ContextParallelCore
from tp_attention.parity import ZERO_GRAD_FLOOR, _randn, rel_err


def draw_case(rng: random.Random, cp: int, impl: str) -> dict:
    """A random attention layer cp can split: MHA or GQA (k/v heads below cp included)."""
    n_kv = rng.choice([1, 2, cp, 2 * cp])
    n_head = n_kv * rng.choice([1, 2, 4])
    if impl == "ulysses" and n_head % cp:
        n_head *= cp
    return dict(
        impl=impl,
        cp=cp,
        n_head=n_head,
        n_kv_head=n_kv,
        head_dim=rng.choice([4, 8, 16]),
        batch=rng.randint(1, 2),
        seq=2 * cp * rng.randint(1, 4),
        bias=rng.random() < 0.5,
    )


def build_reference(case: dict, seed: int, device, dtype=torch.float32) -> torch.nn.Module:
    cfg = GPTConfig(
        d_model=case["n_head"] * case["head_dim"],
        n_head=case["n_head"],
        n_kv_head=case["n_kv_head"],
        bias=case["bias"],
        seq_len=case["seq"],
    )
    torch.manual_seed(seed)
    return Block(cfg, "blocks.0", lambda name, i, o, b: torch.nn.Linear(i, o, bias=b)).attn.to(
        device, dtype
    )


def check_case(
    case: dict,
    group,
    seed: int,
    device,
    core: ContextParallelCore | None = None,
    ref: torch.nn.Module | None = None,
) -> tuple[dict[str, float], dict[str, int]]:
    """Errors per tensor and {analytic, counted} bytes of one case on this rank of `group`.
    `core`: the context-parallel core to test (default: case["impl"]'s); `ref`: a prebuilt
    reference."""
    cp, rank = case["cp"], exchange.rank_in(group)
    ref = ref if ref is not None else build_reference(case, seed, device)
    dtype = ref.wq.weight.dtype
    d = ref.wq.weight.shape[1]
    x = _randn(seed + 1, case["batch"], case["seq"], d, device=device).to(dtype)
    g = _randn(seed + 2, case["batch"], case["seq"], d, device=device).to(dtype)
    ref.zero_grad(set_to_none=True)  # a prebuilt reference may hold an earlier case's gradients
    model = copy.deepcopy(ref)
    model.core = core or ContextParallelCore(case["impl"], group)
    xr = x.clone().requires_grad_()
    ref_out = ref(xr)
    ref_out.backward(g)
    xc = sharding.shard(x, cp, rank).requires_grad_()
    with CommCounter() as counter:
        out = model(xc)
        out.backward(sharding.shard(g, cp, rank))
    floor = ZERO_GRAD_FLOOR * max(float(p.grad.abs().max()) for p in ref.parameters())
    errs = {
        "out": rel_err(out, sharding.shard(ref_out, cp, rank)),
        "input_grad": rel_err(xc.grad, sharding.shard(xr.grad, cp, rank)),
    }
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if cp > 1:
            dist.all_reduce(p.grad, group=group)
        errs[f"grad.{name}"] = rel_err(p.grad, q.grad, floor)
    analytic = exchange.expected_wire_bytes(
        case["impl"],
        batch=case["batch"],
        seq=case["seq"],
        n_head=case["n_head"],
        n_kv_head=case["n_kv_head"],
        head_dim=case["head_dim"],
        cp=cp,
        elem_bytes=torch.empty(0, dtype=dtype).element_size(),
    )
    return errs, {"analytic": analytic, "counted": counter.wire_bytes()}


def failures(errs: dict[str, float], volume: dict[str, int], rtol: float) -> list[str]:
    """What breaks parity: each tensor above rtol, and counted != analytic bytes."""
    bad = [f"{k}={v:.2e}" for k, v in errs.items() if not v <= rtol]
    if volume["analytic"] != volume["counted"]:
        bad.append(f"comm bytes analytic {volume['analytic']} != counted {volume['counted']}")
    return bad
