"""Context parallelism without a process group: zigzag shards, the ring's block plan (exact causal
coverage, equal work on every rank), the online-softmax merge, the fused CPU blocks against their
definition, the analytic volume by hand, and the CP study's refusals."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dtrain.core.errors import UserError
from dtrain.core.nodes import defaults
from dtrain.parallel import comm_counter
from dtrain.parallel.cp import sharding
from dtrain.parallel.cp.exchange import expected_wire_bytes, ulysses_kv_heads
from dtrain.parallel.cp.ring import (
    block_attention,
    block_attention_math,
    block_grads,
    block_grads_math,
    block_plan,
    merge_partials,
    ring_attention,
)
from dtrain.parallel.cp.ulysses import causal_sdpa


def test_zigzag_shards_pair_each_chunk_with_its_mirror():
    assert sharding.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sharding.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sharding.shard_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    assert torch.equal(sharding.unshard([sharding.shard(x, 4, r) for r in range(4)]), x)
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 8"):
        sharding.positions(12, 4, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_block_plan_covers_exactly_the_causal_pairs_with_equal_work_per_rank(cp):
    seq = 4 * cp
    work = []
    for rank in range(cp):
        mine = sharding.positions(seq, cp, rank).tolist()
        pairs, n = set(), 0
        for src in range(cp):
            rows, keys, causal = block_plan(rank, src, len(mine))
            theirs = sharding.positions(seq, cp, src).tolist()
            for i, qpos in enumerate(mine[rows]):
                for j, kpos in enumerate(theirs[keys]):
                    if not causal or j <= i:
                        assert kpos <= qpos, (rank, src)  # never a masked pair
                        pairs.add((qpos, kpos))
                        n += 1
        assert pairs == {(q, k) for q in mine for k in range(q + 1)}  # every causal pair, once
        work.append(n)
    assert len(set(work)) == 1, work  # zigzag: every rank computes as many scores


def test_online_softmax_merge_of_two_key_blocks_is_attention_over_both():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    full, lse = block_attention_math(q, k, v, False, 0.5)
    a, la = block_attention_math(q, k[:, :, :2], v[:, :, :2], False, 0.5)
    b, lb = block_attention_math(q, k[:, :, 2:], v[:, :, 2:], False, 0.5)
    out, merged = merge_partials(a, la, b, lb)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(merged, lse)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_cpu_blocks_equal_their_definition_even_with_another_blocks_out_and_lse(causal):
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(4))
    got, want = block_attention(q, k, v, causal, 0.5), block_attention_math(q, k, v, causal, 0.5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    out, lse = 0.5 * want[0], want[1] + 0.3  # the ring passes the final (merged) out and lse
    for a, b in zip(
        block_grads(q, k, v, out, lse, dout, causal, 0.5),
        block_grads_math(q, k, v, out, lse, dout, causal, 0.5),
    ):
        torch.testing.assert_close(a, b)


def test_ring_of_one_is_causal_sdpa_with_gqa():
    g = torch.Generator().manual_seed(3)
    q, dout = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ring_attention(*leaves, group=None).backward(dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = causal_sdpa(*ref)
    out.backward(dout)
    torch.testing.assert_close(ring_attention(q, k, v, group=None), out.detach())
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_expected_bytes_by_hand():
    assert (
        comm_counter.wire_bytes("send", 1000, 4) == 1000
        and comm_counter.wire_bytes("all_to_all", 1000, 4) == 750
    )
    # b=1, s=8, hd=4, fp32, cp=2: a rank holds 4 tokens; a k/v block with 2 k/v heads = 2*4*2*4*4 =
    # 256 bytes, sent 3(cp-1) = 3 times (forward k/v, backward k/v and its gradient)
    kw = dict(batch=1, seq=8, n_head=4, n_kv_head=2, head_dim=4, cp=2)
    assert expected_wire_bytes("ring", **kw) == 3 * 256
    # ulysses: q and out 4*4*4*4 = 256 bytes, k and v 128 each, half of each leaves the rank, twice
    # (fwd, bwd)
    assert expected_wire_bytes("ulysses", **kw) == 2 * (128 + 64 + 64 + 128)
    assert expected_wire_bytes("ring", **{**kw, "cp": 1}) == 0
    assert (
        ulysses_kv_heads(2, 4) == 4 and ulysses_kv_heads(8, 4) == 8 and ulysses_kv_heads(3, 2) == 6
    )


def study_cfg(**over):
    from tp_attention.conf import CpStudyConfig

    cfg = defaults(CpStudyConfig)
    for key, value in over.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize(
    "over, message",
    [
        ({"model.seq_len": [256, 102]}, "model.seq_len=102 is not divisible by 2 x train.cp = 4"),
        ({"train.cp": [1]}, "train.cp=1 must be an integer in [2, world_size=2]"),
        ({"train.cp": [4]}, "train.cp=4 must be an integer in [2, world_size=2]"),
        ({"train.cp_impl": ["ring", "zigzag"]}, "must name at least one of ring, ulysses"),
        (
            {
                "model.n_head": 2,
                "model.n_kv_head": 1,
                "world_size": 4,
                "train.cp": [4],
                "model.seq_len": [64],
            },
            "train.cp_impl=ulysses needs model.n_head=2 divisible by train.cp=4",
        ),
        ({"iters": 0}, "iters=0 must be an integer >= 1"),
    ],
)
def test_the_study_refuses_what_it_cannot_measure(over, message):
    from tp_attention.cp.study import validate

    validate(study_cfg())  # the defaults run
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(study_cfg(**over))
