"""DeepSpeed's pipeline engine (costmodel/pipeline_engine.py, issue 39): TrainSchedule played out
by hand, its blocking transfers counted against the reference simulation, the time model's
pipeline term for ``--software megatron-deepspeed``, and the search keeping to what each framework
runs."""

from __future__ import annotations

import random

import pytest

from dtrain.costmodel import Cluster, Layout, ModelShape, search, step_time
from dtrain.costmodel.collectives import all_gather_time, group_link, p2p_time
from dtrain.costmodel.pipeline_engine import schedule, simulate, transfers
from dtrain.costmodel.layout_enumeration import layout_fields
from dtrain.costmodel.software import SOFTWARE, unsupported
from dtrain.costmodel.stack import Stack
from dtrain.parallel import traffic


def test_two_stages_two_micro_batches_by_hand():
    """p=2, m=2, forward 1, backward 2, a transfer 0.1: stage 0 F0 [0, 1], sends it (1.1), F1
    [1.1, 2.1]; stage 1 F0 [1.1, 2.1], B0 [2.1, 4.1], sends the gradient back (4.2), receives F1's
    activation (4.3); stage 0 B0 [4.3, 6.3]; stage 1 F1 [4.3, 5.3], B1 [5.3, 7.3], sends it
    (7.4); stage 0 B1 [7.4, 9.4]."""
    assert schedule(0, 2, 2) == [
        ("F", 0, 0),
        ("send", 1, 1),  # SendActivation of micro-batch 0 on the backward step
        ("F", 1, 2),
        ("recv", 1, 3),  # RecvGrad
        ("send", 1, 3),  # SendActivation of micro-batch 1
        ("B", 0, 3),
        ("recv", 1, 5),
        ("B", 1, 5),
    ]
    assert simulate(2, 2, 1.0, 2.0, 0.1) == pytest.approx(9.4)
    assert 9.4 == pytest.approx((2 + 2 - 1) * (1 + 2) + transfers(2, 2) * 0.1)


def test_transfers_match_the_simulation():
    """Without transfers TrainSchedule costs 1F1B's (m + p − 1)(f + b); each transfer on the
    critical path adds its time: ``transfers`` of them."""
    seed = 39
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(40):
        p, m = rng.randint(2, 9), rng.randint(1, 24)
        f = rng.uniform(0.5, 1.5)
        b = f * rng.uniform(1.5, 3.5)
        base = simulate(p, m, f, b, 0.0)
        assert base == pytest.approx((m + p - 1) * (f + b)), (p, m)
        per = (simulate(p, m, f, b, 1e-4) - base) / 1e-4
        assert per == pytest.approx(transfers(p, m), abs=1e-6), (p, m)
    assert [transfers(p, 8) for p in (1, 2, 3, 4, 35)] == [0, 16, 30, 32, 94]
    assert transfers(35, 240) == 4 * 240 + 2 * 31


def test_the_engine_term_in_the_step():
    """megatron-deepspeed's pp_comm: transfers(p, m) blocking p2p of b·s·h/tp values, 2m
    all-gathers over TP rebuilding the partitioned tensors; Megatron's: 2m sends. The rest of
    the step is the same."""
    shape = ModelShape(8, 2048, 16, 16, 32000, 2048, 4.0, False)
    cluster = Cluster.from_profile("a100-80gb", 32, 8)
    lay = Layout(dp_shard=2, tp=4, pp=4, zero_stage=1, recompute="full", grad_accum=8)
    mega = step_time(shape, lay, cluster, stack=Stack(software="megatron-core"))
    ds = step_time(shape, lay, cluster, stack=Stack(software="megatron-deepspeed"))
    act = traffic.pp_activation_bytes(1, 2048, 2048, 2, 1, 4)
    hop = p2p_time(act, cluster.ib)  # 32 GPUs: the stages span nodes
    gather = all_gather_time(act * 4, 4, group_link(cluster, 4, 1, multi_rail=False))
    assert mega.pp_comm == pytest.approx(2 * 8 * hop)
    assert ds.pp_comm == pytest.approx(transfers(4, 8) * hop + 2 * 8 * gather)
    # the rest of the step differs by DeepSpeed's BF16_Optimizer copy (test below), on every
    # micro-batch: in the compute and, in proportion, in the bubble
    assert mega.grad_accum == 0.0 and ds.grad_accum > 0
    assert ds.compute - mega.compute == pytest.approx(ds.grad_accum)
    per_work = mega.bubble / (mega.compute - mega.terms.optimizer + mega.tp_comm)
    assert ds.bubble - mega.bubble == pytest.approx(per_work * ds.grad_accum)
    assert ds.total - mega.total == pytest.approx(
        ds.pp_comm - mega.pp_comm + ds.grad_accum + ds.bubble - mega.bubble
    )


def test_bf16_optimizer_copy_by_hand():
    """DeepSpeed with fp32 gradient accumulation (its BF16_Optimizer) upcasts and adds each
    micro-batch's gradients into the fp32 copy: 18 B per stage parameter, every micro-batch
    (8 here); with 16-bit gradients (ZeRO-1's own path) autograd adds them in place, 6 B per
    parameter after the first; ZeRO-2 and Megatron (fused into the GEMM) have neither."""
    from dtrain.costmodel.calibration import Calibration
    from dtrain.costmodel.device_rates import device_of
    from dtrain.costmodel.model_states import params_per_gpu
    from dtrain.costmodel.pipeline_engine import HP_GRAD_BYTES, hp_grad_update_s

    shape = ModelShape(8, 2048, 16, 16, 32000, 2048, 4.0, False)
    cluster = Cluster.from_profile("a100-80gb", 32, 8)
    lay = Layout(dp_shard=2, tp=4, pp=4, zero_stage=1, recompute="full", grad_accum=8)
    fp32 = Stack(software="megatron-deepspeed")
    dev = device_of(cluster, Calibration(), fp32)
    psi = params_per_gpu(shape, 4, 4)
    assert HP_GRAD_BYTES == 2 + 4 + 3 * 4  # to(fp32): r 2, w 4; add_: r 4 + 4, w 4
    assert hp_grad_update_s(psi, 8, dev) == pytest.approx(8 * dev.mem_s(18 * psi, "add"))
    assert step_time(shape, lay, cluster, stack=fp32).grad_accum == pytest.approx(
        8 * dev.mem_s(18 * psi, "add")
    )
    half = Stack(software="megatron-deepspeed", grad_reduce="bf16")
    assert step_time(shape, lay, cluster, stack=half).grad_accum == pytest.approx(
        7 * dev.mem_s(6 * psi, "add")
    )
    zero2 = Layout(dp_shard=32, zero_stage=2, grad_accum=8)
    assert step_time(shape, zero2, cluster, stack=fp32).grad_accum == 0.0
    assert step_time(shape, lay, cluster, stack=Stack(software="megatron-core")).grad_accum == 0


@pytest.fixture(scope="module")
def ranked():
    shape = ModelShape(16, 2048, 16, 16, 32000, 2048, 4.0, False)
    cluster = Cluster.from_profile("a100-80gb", 32, 8)
    return shape, {
        n: search(shape, cluster, 64, stack=Stack(software=n)).ranked
        for n in ("any", "megatron-deepspeed", "megatron-core", "torchtitan")
    }


def test_search_yields_only_the_frameworks_layouts(ranked):
    shape, by = ranked
    ds = by["megatron-deepspeed"]
    assert ds and any(p.pp > 1 for p in ds)
    assert not any(p.pp > 1 and p.zero_stage >= 2 for p in ds)  # the engine refuses ZeRO-2/3
    assert not any(p.virtual_stages > 1 or p.pp_schedule != "1f1b" for p in ds)
    assert not any(p.recompute not in ("none", "full") for p in ds)
    assert any(p.pp > 1 and p.zero_stage >= 2 for p in by["any"])
    assert not any(p.zero_stage == 1 for p in by["torchtitan"])
    for name in ("megatron-deepspeed", "megatron-core", "torchtitan"):
        for p in by[name]:
            assert unsupported(SOFTWARE[name], layout_fields(p), shape.n_layer) is None


def test_schedules_and_overlaps_each_framework_runs():
    fields = {"pp": 4, "pp_schedule": "zbv"}
    assert unsupported(SOFTWARE["megatron-deepspeed"], fields) == (
        "schedule=zbv (it runs schedule=1f1b)"
    )
    assert unsupported(SOFTWARE["megatron-core"], {"pp": 4, "pp_schedule": "gpipe"})
    assert unsupported(SOFTWARE["torchtitan"], fields) is None
    with pytest.raises(ValueError, match="torchtitan has no tp_overlap"):
        Stack(software="torchtitan", tp_overlap=True)
    with pytest.raises(ValueError, match="megatron-core has no async_tp"):
        Stack(software="megatron-core", async_tp=True)
    Stack(software="megatron-core", tp_overlap=True)
    Stack(software="any", async_tp=True)
