"""In-process checks with no process group: the analytic volume formula, head-layout errors, and
tp=1 (every operator the identity) against dtrain.model.gpt."""

from __future__ import annotations

import random

import pytest
import torch

from dtrain.core.errors import UserError
from dtrain.model.gpt import Block, GPTConfig
from dtrain.parallel.feasibility import check_tp_heads
from dtrain.parallel.tp import tp_collectives
from dtrain.parallel.tp.attention import TensorParallelBlock, TPGroups, kv_heads_of
from dtrain.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear


def test_wire_bytes_ring_formulas():
    assert tp_collectives.wire_bytes("all_reduce", 1000, 4) == 1500  # 2 (n-1)/n S
    assert tp_collectives.wire_bytes("all_gather", 1000, 4) == 750  # (n-1)/n S
    assert tp_collectives.wire_bytes("reduce_scatter", 1000, 4) == 750
    assert tp_collectives.wire_bytes("all_reduce", 1000, 1) == 0


def test_expected_bytes_block_by_hand():
    # b=2, s=8, h=16 fp32: an activation is 1024 bytes; a block = 4 all-reduces, each 2*(1/2)*1024
    # on tp=2
    kw = dict(batch=2, seq=8, d_model=16, n_head=4, n_kv_head=4, tp=2)
    assert tp_collectives.expected_wire_bytes(sequence_parallel=False, **kw) == {
        "activation": 4096,
        "grad_sync": 0,
    }
    # SP: 4 all-gathers + 4 reduce-scatters of 1024 bytes, 512 each: the same volume
    # plus the two RMSNorm weights' partial grads (2 x 16 fp32 = 128 bytes) all-reduced: 128
    assert tp_collectives.expected_wire_bytes(sequence_parallel=True, **kw) == {
        "activation": 4096,
        "grad_sync": 128,
    }
    # attention alone: one TP region, half the activation traffic; no norms
    assert (
        tp_collectives.expected_wire_bytes(sequence_parallel=False, module="attention", **kw)[
            "activation"
        ]
        == 2048
    )


def test_expected_bytes_replicated_kv_heads():
    # n_kv_head=1 < tp=4: every rank holds wk and wv whole (2 x head_dim=4 rows of 16 + bias)
    # and sums their grads over all 4 ranks: payload 8 * 17 * 4 = 544 bytes, wire 2 * 3/4 * 544 =
    # 816
    kw = dict(batch=1, seq=4, d_model=16, n_head=4, tp=4, bias=True)
    assert (
        tp_collectives.expected_wire_bytes(n_kv_head=1, sequence_parallel=False, **kw)["grad_sync"]
        == 816
    )
    # two k/v heads on tp=4: both whole on every rank, 16 rows: payload 16 * 17 * 4 = 1088, wire
    # 1632
    assert (
        tp_collectives.expected_wire_bytes(n_kv_head=2, sequence_parallel=False, **kw)["grad_sync"]
        == 1632
    )
    # with SP the norm weights (2 x 16) and row biases (2 x 16) join the same all-reduce over tp:
    # (136 + 64) * 4 = 800 bytes, wire 2 * 3/4 * 800 = 1200
    assert (
        tp_collectives.expected_wire_bytes(n_kv_head=1, sequence_parallel=True, **kw)["grad_sync"]
        == 1200
    )


@pytest.mark.parametrize(
    "n_head,n_kv,tp,message",
    [
        (6, 6, 4, "n_head=6 is not divisible by tp=4"),
        (8, 6, 2, "n_head=8 is not divisible by n_kv_head=6"),
        (12, 6, 4, "n_kv_head=6 is not divisible by tp=4"),
        (12, 3, 4, "tp=4 is not a multiple of n_kv_head=3"),
    ],
)
def test_bad_head_layouts_say_what_to_change(n_head, n_kv, tp, message):
    with pytest.raises(UserError, match=message):
        check_tp_heads(n_head, n_kv, tp)


def test_kv_heads_of_rank():
    assert [list(kv_heads_of(r, 4, 8)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(kv_heads_of(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]  # replicated


def test_tp1_layers_equal_linear_without_a_process_group():
    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 8)
    x = torch.randn(2, 3, 12)
    col = ColumnParallelLinear.from_full(ref.weight, ref.bias, rank=0, tp=1)
    row = RowParallelLinear.from_full(ref.weight, ref.bias, rank=0, tp=1)
    torch.testing.assert_close(col(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(row(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "sp,fused,async_",
    [(False, True, False), (True, False, False), (False, True, True), (True, False, True)],
)
def test_tp1_block_equals_dtrain_block(sp, fused, async_):
    seed = 1000 + 4 * sp + 2 * fused + async_  # a different (fixed) random shape per case
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n_head = rng.choice([2, 4])
    cfg = GPTConfig(
        d_model=n_head * rng.choice([4, 8]),
        n_head=n_head,
        n_kv_head=rng.choice([1, n_head]),
        bias=rng.random() < 0.5,
        norm=rng.choice(["rmsnorm", "layernorm"]),
    )
    block = Block(cfg, "blocks.0", lambda n, i, o, b: torch.nn.Linear(i, o, bias=b))
    tp_block = TensorParallelBlock.from_full(
        block,
        TPGroups(None, 0, 1),
        sequence_parallel=sp,
        fused_qkv=fused,
        async_grad_allreduce=async_,
    )
    x = torch.randn(rng.randint(1, 3), rng.randint(1, 9), cfg.d_model)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    block(xr).sum().backward()
    tp_block(xt).sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        tp_block.mlp.w1.weight.grad, block.mlp.w1.weight.grad, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        tp_block.attn.wo.weight.grad, block.attn.wo.weight.grad, rtol=1e-5, atol=1e-6
    )
