"""FP8 all-gathers in the cost model (``Stack.fp8_all_gather``): an FP8 run's sequence-parallel
all-gathers move 1-byte values while its reduce-scatters stay bf16 (torchao's Float8 TP styles,
TransformerEngine), and with "tp+fsdp" FSDP's weight all-gathers move the block linears in FP8
(torchao enable_fsdp_float8_all_gather). Traffic by hand, bf16 runs untouched, the vocabulary's
errors, and the plan flag end to end."""

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel import Cluster, Layout, ModelShape, params_per_gpu, step_time
from dtrain.costmodel.collectives import (
    all_gather_time,
    allreduce_time,
    group_link,
    reduce_scatter_time,
)
from dtrain.costmodel.links import default_links
from dtrain.costmodel.model_states import embedding_params_per_gpu
from dtrain.costmodel.stack import Stack

SHAPE = ModelShape(32, 4096, 32, 8, 32000, 4096, 3.5, True)
CLUSTER = default_links().apply(Cluster.from_profile("h100-sxm", 64, 8, ib_gbit_per_gpu=400))
TP_SP = Layout(
    dp_shard=8,
    tp=8,
    zero_stage=3,
    recompute="none",
    micro_batch=2,
    grad_accum=4,
    sequence_parallel=True,
)  # dp 8 x tp 8, SP, 4 micro-batches of 2


def test_fp8_tp_all_gathers_move_one_byte_and_the_reduce_scatters_two():
    """Per layer and micro-batch, no recompute: 4 all-gather + reduce-scatter pairs of b·s·h
    values over the node's 8 ranks; FP8 halves the gathers' bytes only."""
    link = group_link(CLUSTER, 8, 1, multi_rail=False)
    values = 2 * SHAPE.seq_len * SHAPE.d_model
    pair_fp8 = all_gather_time(values * 1, 8, link) + reduce_scatter_time(values * 2, 8, link)
    want = SHAPE.n_layer * 4 * 4 * pair_fp8
    fp8 = step_time(SHAPE, TP_SP, CLUSTER, precision="fp8", stack=Stack(fp8_all_gather="tp"))
    none = step_time(SHAPE, TP_SP, CLUSTER, precision="fp8", stack=Stack(fp8_all_gather="none"))
    assert fp8.tp_comm == pytest.approx(want)
    assert none.tp_comm == pytest.approx(
        SHAPE.n_layer * 4 * 4 * allreduce_time(values * 2, 8, link)
    )
    assert fp8.tp_comm < 0.8 * none.tp_comm  # 3/4 of the bytes, the same α


def test_tp_without_sequence_parallel_all_reduces_in_bf16():
    lay = Layout(
        dp_shard=8,
        tp=8,
        zero_stage=3,
        recompute="none",
        micro_batch=2,
        grad_accum=4,
        sequence_parallel=False,
    )
    a = step_time(SHAPE, lay, CLUSTER, precision="fp8", stack=Stack(fp8_all_gather="tp"))
    b = step_time(SHAPE, lay, CLUSTER, precision="fp8", stack=Stack(fp8_all_gather="none"))
    assert a.tp_comm == b.tp_comm > 0


def test_fsdp_fp8_all_gather_gathers_the_linears_in_one_byte():
    """ZeRO-3, per micro-batch: two all-gathers of the stage's weights, the block linears at 1
    byte and the embedding and output matrices at 2, one fp32 reduce-scatter; plus the per-unit
    latency."""
    psi, emb = params_per_gpu(SHAPE, 8, 1), embedding_params_per_gpu(SHAPE, 8, 1)
    assert emb == pytest.approx(2 * SHAPE.vocab * SHAPE.d_model / 8)
    link = group_link(CLUSTER, 8, 8, multi_rail=True)
    ag, rs = all_gather_time((psi - emb) + 2 * emb, 8, link), reduce_scatter_time(4 * psi, 8, link)
    lat_ag, lat_rs = (
        SHAPE.n_layer * 7 * link.of(c).alpha_s for c in ("all_gather", "reduce_scatter")
    )
    t = step_time(SHAPE, TP_SP, CLUSTER, precision="fp8", stack=Stack(fp8_all_gather="tp+fsdp"))
    assert t.dp_comm == pytest.approx(4 * (rs + lat_rs) + 4 * 2 * (ag + lat_ag))
    bf16_weights = step_time(
        SHAPE, TP_SP, CLUSTER, precision="fp8", stack=Stack(fp8_all_gather="tp")
    )
    assert t.dp_comm < bf16_weights.dp_comm and t.tp_comm == bf16_weights.tp_comm


def test_a_bf16_run_moves_bf16_whatever_the_fp8_setting():
    times = {
        g: step_time(SHAPE, TP_SP, CLUSTER, stack=Stack(fp8_all_gather=g)).total
        for g in ("none", "tp", "tp+fsdp")
    }
    assert len(set(times.values())) == 1


def test_stack_refuses_an_unknown_fp8_all_gather():
    with pytest.raises(
        ValueError, match=r"fp8_all_gather='[^']*' must be one of none, tp, tp\+fsdp"
    ):
        Stack(fp8_all_gather="fsdp")


BASE = [
    "plan",
    "--params",
    "8e9",
    "--gpus",
    "64",
    "--global-batch",
    "64",
    "--precision",
    "fp8",
    "--json",
    "--top",
    "0",
    "--layout",
    "dp=8 tp=8 zero=3 sp=on mb=1",
]


def test_plan_flag_reaches_the_prediction(capsys):
    out = {}
    for gathers in ("none", "tp", "tp+fsdp"):
        assert main([*BASE, "--fp8-all-gather", gathers]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["fp8_all_gather"] == gathers
        out[gathers] = res["layout"]["step_time_s"]
    assert out["tp"]["tp_comm"] < out["none"]["tp_comm"]
    assert out["tp+fsdp"]["dp_comm"] < out["tp"]["dp_comm"]


def test_plan_refuses_an_unknown_fp8_all_gather(capsys):
    assert main([*BASE, "--fp8-all-gather", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dtrain plan: argument --fp8-all-gather: invalid choice: 'fsdp'")
    assert err.count("\n") == 1


def test_plan_prices_fp8_casts_by_the_softwares_scaling(capsys):
    """`dtrain plan --precision fp8`: torchtitan's dynamic scaling pays 13.8 B per cast element,
    Megatron's delayed 3 (FP8_CAST_BYTES); the JSON names the scaling; --fp8-scaling overrides
    the software's, a wrong one is refused. (The memory-bound terms compared without the
    gradient accumulation, which Megatron fuses into its GEMMs.)"""
    import json

    from dtrain.cli.main import main

    def memory(*extra):
        assert (
            main(
                [
                    "plan",
                    "--params",
                    "8e9",
                    "--gpus",
                    "8",
                    "--precision",
                    "fp8",
                    "--layout",
                    "dp=1 tp=8 pp=1 zero=0 recompute=full mb=1",
                    "--json",
                    *extra,
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        st = out["layout"]["step_time_s"]  # the casts: memory-bound time less the gradient adds
        return out["fp8_scaling"], st["compute_terms"]["memory"] - st["grad_accum"], st

    titan, mega, forced = (
        memory("--software", "torchtitan"),
        memory("--software", "megatron-core"),
        memory("--software", "torchtitan", "--fp8-scaling", "delayed"),
    )
    assert titan[0] == "dynamic" and mega[0] == "delayed" and forced[0] == "delayed"
    assert forced[1] == pytest.approx(mega[1]) and titan[1] > mega[1]
    # torchtitan adds each micro-batch's gradients in a pass of its own, Megatron in the GEMM
    assert titan[2]["grad_accum"] > 0 and mega[2]["grad_accum"] == 0
    assert main(["plan", "--params", "8e9", "--gpus", "8", "--fp8-scaling", "per-row"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: dtrain plan: argument --fp8-scaling: invalid choice: 'per-row' "
        "(choose from 'delayed', 'dynamic', 'eager') (see dtrain plan --help)"
    )
