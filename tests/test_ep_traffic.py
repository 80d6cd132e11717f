"""Expert parallelism's bytes: what the dispatch / combine all-to-alls of one MoE layer send,
counted by a CommCounter on 2 gloo ranks, equal dtrain.parallel.traffic's formulas (the ones the
cost model prices): balanced routing gives ep_dispatch_bytes' all-to-all and ep_layer_bytes, any
routing the uneven per-rank sum ep_uneven_wire_bytes; the token counts go first as one even
all-to-all of E int64."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conftest import local_cpu_run
from dtrain.model.gpt import GPT, GPTConfig, moe_layers
from dtrain.model.moe_args import MoEArgs
from dtrain.parallel import traffic
from dtrain.parallel.comm_counter import CommCounter
from dtrain.parallel.ep.trainer_ep import apply_expert_parallel
from dtrain.parallel.mesh import ParallelDims
from dtrain.run.launch import launch

TOKENS, D, E = 16, 64, 4


def _layer(balanced: bool):
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("tiny", moe=MoEArgs(experts=E, top_k=2, router="sigmoid"))
    model = GPT(cfg)
    dims = ParallelDims(2, dp_shard=2, ep=2)
    apply_expert_parallel(model, dims.build_expert_mesh("cpu")["ep"])
    layer = moe_layers(model)[0]
    if balanced:  # every token to experts 0 (rank 0) and 2 (rank 1): one row to each rank
        with torch.no_grad():
            layer.router.gate.weight.zero_()
            layer.router.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.5, 0.0]))
    return layer


def count(ctx) -> dict:
    out = {}
    rank = dist.get_rank()
    for balanced in (True, False):
        layer = _layer(balanced)
        torch.manual_seed(100 + rank)  # each rank its own tokens
        x = torch.randn(1, TOKENS, D, requires_grad=True)
        with CommCounter() as c:
            layer(x).square().sum().backward()
        counts = layer.stats["tokens_per_expert"]
        # rows this rank sent each rank: its assignments to that rank's experts
        rows_to = [int(counts[:2].sum()), int(counts[2:].sum())]
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor(rows_to))
        received = [int(g[rank]) for g in gathered]  # rows each rank sent this one
        out[balanced] = {
            "dispatch": c.wire_bytes(traffic.DISPATCH),
            "combine": c.wire_bytes(traffic.COMBINE),
            "grads": c.wire_bytes(traffic.DISPATCH + "_grad")
            + c.wire_bytes(traffic.COMBINE + "_grad"),
            "counts": c.wire_bytes(traffic.COUNTS),
            "total": c.wire_bytes(),
            "rows_to": rows_to,
            "received": received,
        }
    return out


def test_counted_ep_bytes_equal_the_traffic_formulas(tmp_path):
    cfg = local_cpu_run(2)
    got = launch(count, cfg, tmp_path)[0]  # rank 0's counts
    bal, uneven = got[True], got[False]
    row = D * 4  # fp32
    dispatch = traffic.wire_bytes("all_to_all", traffic.ep_dispatch_bytes(TOKENS, 2, D, 4), 2)
    assert bal["dispatch"] == bal["combine"] == dispatch
    assert bal["total"] - bal["counts"] == traffic.ep_layer_bytes(TOKENS, 2, D, 2, 4, 4)
    assert bal["counts"] == traffic.wire_bytes("all_to_all", E * traffic.EP_COUNT_BYTES, 2)
    # uneven: the dispatch sends rows_to, the combine sends back what arrived (and the gradients
    # the reverse of each)
    sent = traffic.ep_uneven_wire_bytes(uneven["rows_to"], 0, D, 4)
    back = traffic.ep_uneven_wire_bytes(uneven["received"], 0, D, 4)
    assert uneven["rows_to"] != [TOKENS, TOKENS]
    assert (uneven["dispatch"], uneven["combine"]) == (sent, back)
    assert uneven["grads"] == sent + back
    assert sent == uneven["rows_to"][1] * row
