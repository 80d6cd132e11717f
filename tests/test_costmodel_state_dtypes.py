"""Gradient and optimizer-state dtypes in the cost model (``Stack.grad_reduce``,
``Stack.optimizer_states``): bf16 gradients halve the gradient buffers and the DP reduction's
bytes; bf16 Adam moments without an fp32 master copy (apex DistributedFusedAdam with dtype bf16,
as NeMo runs it) keep 4 bytes of optimizer state per parameter. Bytes by hand, traffic by hand,
the fp32 defaults untouched, the Nemotron-4 row as its recipe runs, errors, and the plan flags
end to end."""

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel import Cluster, Layout, ModelShape, memory_per_gpu, params_per_gpu, step_time
from dtrain.costmodel.published_runs import load_rows, row_setup
from dtrain.costmodel.collectives import all_gather_time, group_link, reduce_scatter_time
from dtrain.costmodel.links import default_links
from dtrain.costmodel.activations import activation_bytes
from dtrain.costmodel.model_states import model_state_bytes
from dtrain.costmodel.stack import Stack

SHAPE = ModelShape(32, 4096, 32, 8, 32000, 4096, 3.5, True)
CLUSTER = default_links().apply(Cluster.from_profile("h100-sxm", 64, 8, ib_gbit_per_gpu=400))
BF16 = Stack(grad_reduce="bf16", optimizer_states="bf16")


@pytest.mark.parametrize(
    "stage, want",
    [
        (0, (2, 2, 4)),  # bf16 weights, bf16 gradient buffer, bf16 m and v: 8 B, nothing sharded
        (
            1,
            (2, 2, 4 / 16),
        ),  # the optimizer states sharded (NeMo's distributed_fused_adam, Megatron's distopt)
        (2, (2, 2 / 16, 4 / 16)),
        (3, (2 / 16, 2 / 16, 4 / 16)),  # everything sharded, in bf16
    ],
)
def test_bf16_states_bytes_by_hand(stage, want):
    psi = 1e9
    assert model_state_bytes(psi, stage, 16, 2, "bf16") == pytest.approx(
        tuple(w * psi for w in want)
    )


def test_bf16_gradients_alone_and_the_fp32_defaults():
    psi, n = 1e9, 16
    assert model_state_bytes(psi, 1, n, 2) == pytest.approx((2 * psi, 2 * psi, 12 * psi / n))
    # FSDP2's reduced shard takes its fp32 parameter's dtype: stage 3 keeps 16 B/param with bf16
    # reduction
    assert model_state_bytes(psi, 3, n, 2) == pytest.approx((4 * psi / n, 4 * psi / n, 8 * psi / n))
    assert model_state_bytes(psi, 1, n) == pytest.approx(
        (2 * psi, 4 * psi, 12 * psi / n)
    )  # Megatron: 6 + 12/d


def test_zero3_under_pp_accumulates_in_the_reduce_dtype():
    """A pipeline stage keeps its bf16 weights and its unsharded gradient accumulator: (2 + 4)Ψ,
    (2 + 2)Ψ in bf16."""
    lay = Layout(
        dp_shard=4,
        tp=2,
        pp=4,
        zero_stage=3,
        recompute="full",
        micro_batch=1,
        grad_accum=8,
        sequence_parallel=True,
    )
    psi = params_per_gpu(SHAPE, 2, 4)
    assert memory_per_gpu(SHAPE, lay).buffers == pytest.approx(6 * psi)
    assert memory_per_gpu(SHAPE, lay, grad_bytes=2).buffers == pytest.approx(4 * psi)


def test_bf16_reduction_halves_the_gradient_traffic():
    """ZeRO-1 over 8 nodes (tp 8 fills a node): one reduce-scatter of the gradients and one
    all-gather of the bf16 weights per step; bf16 gradients move 2Ψ bytes instead of 4Ψ, the
    weights 2Ψ either way."""
    lay = Layout(
        dp_shard=8,
        tp=8,
        zero_stage=1,
        recompute="none",
        micro_batch=1,
        grad_accum=4,
        sequence_parallel=True,
    )
    psi = params_per_gpu(SHAPE, 8, 1)
    link = group_link(CLUSTER, 8, 8, multi_rail=True)
    for stack, grad in ((Stack(), 4), (Stack(grad_reduce="bf16"), 2)):
        t = step_time(SHAPE, lay, CLUSTER, stack=stack)
        assert t.dp_comm == pytest.approx(
            reduce_scatter_time(grad * psi, 8, link) + all_gather_time(2 * psi, 8, link)
        )


def test_stack_refuses_an_unknown_dtype():
    with pytest.raises(ValueError, match=r"grad_reduce='fp16' must be one of fp32, bf16"):
        Stack(grad_reduce="fp16")
    with pytest.raises(ValueError, match=r"optimizer_states='fp8' must be one of fp32, bf16"):
        Stack(optimizer_states="fp8")


def test_nemotron_row_holds_what_its_recipe_allocates():
    """NeMo 24.09's distributed_fused_adam with dtype and grad_sync_dtype bf16 (store_params
    False): 2 + 2 bytes of replicated weights and gradients and 4/dp of moments per parameter, 6
    B at dp 2, not Megatron's 6 + 12/2."""
    row = next(r for r in load_rows() if r["name"].startswith("NVIDIA DGXC Nemotron-4 340B"))
    s = row_setup(row)
    assert (s.stack.grad_reduce, s.stack.optimizer_states, s.layout.zero_stage, s.layout.dp) == (
        "bf16",
        "bf16",
        1,
        2,
    )
    psi = params_per_gpu(s.shape, 8, 8)
    m = memory_per_gpu(
        s.shape,
        s.layout,
        1.0,
        s.stack.flash,
        s.stack.fused_loss,
        s.stack.grad_bytes,
        s.stack.optimizer_states,
    )
    assert m.params + m.grads + m.optimizer == pytest.approx(6 * psi)
    assert m.activations == pytest.approx(activation_bytes(s.shape, s.layout, 1.0, True, True))
    assert (
        m.total < 80 * 2**30 < memory_per_gpu(s.shape, s.layout).total
    )  # fits; with fp32 states it would not


BASE = [
    "plan",
    "--params",
    "8e9",
    "--gpus",
    "64",
    "--global-batch",
    "64",
    "--json",
    "--top",
    "0",
    "--layout",
    "dp=8 tp=8 zero=1 sp=on mb=1",
]


def test_plan_flags_reach_memory_and_traffic(capsys):
    res = {}
    for flags in ([], ["--grad-reduce", "bf16", "--optimizer-states", "bf16"]):
        assert main([*BASE, *flags]) == 0
        res[bool(flags)] = json.loads(capsys.readouterr().out)
    assert (res[True]["grad_reduce"], res[True]["optimizer_states"]) == ("bf16", "bf16")
    assert (res[False]["grad_reduce"], res[False]["optimizer_states"]) == ("fp32", "fp32")
    fp32, bf16 = res[False]["layout"]["memory_bytes"], res[True]["layout"]["memory_bytes"]
    assert bf16["grads"] == pytest.approx(fp32["grads"] / 2)
    assert bf16["optimizer"] == pytest.approx(
        fp32["optimizer"] / 3
    )  # 4 B of moments instead of 12 B of states
    assert (
        res[True]["layout"]["step_time_s"]["dp_comm"]
        < res[False]["layout"]["step_time_s"]["dp_comm"]
    )


def test_plan_refuses_an_unknown_dtype(capsys):
    assert main([*BASE, "--optimizer-states", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dtrain plan: argument --optimizer-states: invalid choice: 'fp16'")
    assert err.count("\n") == 1
