"""Context parallelism in the cost model (issue 21 long context, issue 24's vocabulary): the
degrees a sequence can be split over, the ring's and Ulysses' traffic against hand-computed
values, the memory it frees, the search choosing it for long sequences and saying why, and the
plan as trainer overrides."""

from __future__ import annotations

import json

import pytest

from dtrain.costmodel.calibration import Calibration, Param
from dtrain.costmodel.hardware import Cluster
from dtrain.costmodel.activations import activation_bytes, cp_buffer_bytes
from dtrain.costmodel.memory import memory_per_gpu
from dtrain.costmodel.overrides import train_overrides
from dtrain.costmodel.layout_space import context_parallel_degrees
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.timemodel import step_model

LLAMA8B_128K = ModelShape(32, 4096, 32, 8, 128256, 131072, 3.5, True, name="llama3-8b")
H100x64 = Cluster.from_profile("h100-sxm", 64, 8)


def test_cp_degrees_leave_chunks_of_at_least_2048_tokens_and_always_include_1():
    """2·cp load-balanced chunks of >= 2048 tokens: 131072 -> up to 32; 4096 -> 1 only (cp=2:
    1024 each)."""
    assert context_parallel_degrees(LLAMA8B_128K, 64) == [1, 2, 4, 8, 16, 32]
    short = ModelShape(32, 4096, 32, 8, 128256, 4096, 3.5, True)
    assert context_parallel_degrees(short, 64) == [1]
    assert context_parallel_degrees(LLAMA8B_128K, 8) == [1, 2, 4, 8]


def _no_overlap():
    return Calibration(cp_overlap=Param(0.0, "measured here: test"))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_traffic_is_three_passes_of_the_kv_chunk_per_layer(cp):
    """Per layer and micro-batch: (cp−1) sends of the rank's K and V (2·b·s/cp·kv_heads·hd·2 B)
    forward, twice that backward, each α + B/β over NVLink (cp ≤ 8 ranks in one node); nothing
    hidden here."""
    m = step_model(LLAMA8B_128K, H100x64, _no_overlap())
    lay = Layout(
        dp_shard=64 // cp, cp=cp, zero_stage=3, recompute="none", micro_batch=1, grad_accum=2
    )
    link = H100x64.nvlink.of("sendrecv")
    chunk = 2 * 1 * (131072 / cp) * 8 * 128 * 2
    want = 3 * (cp - 1) * (chunk / link.beta_Bps + link.alpha_s) * 32 * 2
    assert m.cp_comm(lay, attention_s=0.0) == pytest.approx(want, rel=1e-12)
    full = Layout(
        dp_shard=64 // cp, cp=cp, zero_stage=3, recompute="full", micro_batch=1, grad_accum=2
    )  # full recompute runs the forward's sends again
    assert m.cp_comm(full, 0.0) == pytest.approx(want * 4 / 3, rel=1e-12)


def test_ring_sends_hide_behind_attention_at_the_overlap_cost():
    """The sends overlap up to the attention they run behind; the overlapped part still costs the
    share a measured cp_overlap leaves (1 − 0.5 here), or by default the NCCL kernel's SMs (1 −
    cp_overlap) plus its ring's HBM traffic, 3 x β(NVLink) / HBM (collectives.overlap_cost)."""
    lay = Layout(dp_shard=8, cp=8, zero_stage=3, recompute="none", micro_batch=1, grad_accum=1)
    sends = step_model(LLAMA8B_128K, H100x64, _no_overlap()).cp_comm(lay, 0.0)
    half = step_model(
        LLAMA8B_128K, H100x64, Calibration(cp_overlap=Param(0.5, "measured here: test"))
    )
    assert half.cp_comm(lay, attention_s=sends / 2) == pytest.approx(sends / 2 + sends / 2 * 0.5)
    assert half.cp_comm(lay, attention_s=10 * sends) == pytest.approx(sends * 0.5)
    default = Calibration()
    cost = (1 - default.cp_overlap.value) + 3 * H100x64.nvlink.beta_Bps / (
        H100x64.gpu.hbm_tbps * 1e12
    )
    assert cost == pytest.approx(
        0.1 + 3 * 450e9 / 3.35e12
    )  # SMs (1 − the fitted 0.9), + HBM at the datasheet NVLink rate this cluster has
    got = step_model(LLAMA8B_128K, H100x64, default).cp_comm(lay, attention_s=10 * sends)
    assert got == pytest.approx(sends * cost, rel=1e-12)


def test_ulysses_all_to_alls_are_never_hidden():
    """2 all-to-alls' worth per layer (forward, backward): (cp−1) pieces of tokens·(2q + 2kv)·2 B
    / cp each."""
    cp = 4
    m = step_model(LLAMA8B_128K, H100x64, Calibration(cp_overlap=Param(1.0, "measured here: test")))
    lay = Layout(
        dp_shard=16,
        cp=cp,
        zero_stage=3,
        recompute="none",
        micro_batch=1,
        grad_accum=1,
        cp_impl="ulysses",
    )
    link = H100x64.nvlink
    tokens = 131072 / cp
    want = (
        2 * (cp - 1) * (tokens * (2 * 4096 + 2 * 1024) * 2 / cp / link.beta_Bps + link.alpha_s) * 32
    )
    assert m.cp_comm(lay, attention_s=1e9) == pytest.approx(want, rel=1e-12)


def test_cp_divides_activations_by_cp_plus_the_rings_buffers():
    """A rank keeps the activations of its s/cp tokens; the ring adds its K/V send and receive
    buffers and their gradients: 2·2·2·b·(s/cp)·kv_heads·hd bytes."""
    one = Layout(dp_shard=8, zero_stage=3, recompute="none", micro_batch=1, grad_accum=1)
    four = Layout(dp_shard=2, cp=4, zero_stage=3, recompute="none", micro_batch=1, grad_accum=1)
    assert cp_buffer_bytes(LLAMA8B_128K, one) == 0
    assert cp_buffer_bytes(LLAMA8B_128K, four) == 2 * 2 * 2 * 1 * (131072 / 4) * 8 * 128
    # (tp=1 has no SP: Megatron's 5% of temporaries scale everything, the buffers too)
    assert activation_bytes(LLAMA8B_128K, four) - 1.05 * cp_buffer_bytes(
        LLAMA8B_128K, four
    ) == pytest.approx(activation_bytes(LLAMA8B_128K, one) / 4, rel=1e-9)
    # states shard over dp·cp: cp=4 x dp=2 holds what dp=8 does
    assert memory_per_gpu(LLAMA8B_128K, four).params == pytest.approx(
        memory_per_gpu(LLAMA8B_128K, one).params
    )


def test_plan_picks_context_parallelism_for_128k_tokens_and_says_why(capsys):
    from dtrain.cli.main import main

    args = [
        "plan",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--gated-mlp",
        "--seq",
        "131072",
        "--gpus",
        "64",
        "--global-batch",
        "64",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "cp=" in text.split("choice:")[1].splitlines()[0]
    assert "splits each 131,072-token sequence over" in text
    assert "without context parallelism the best plan" in " ".join(text.split())  # wrapped
    assert main([*args, "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["choice"]
    assert c["cp"] > 1 and c["dp"] * c["cp"] * c["tp"] * c["pp"] == 64


def test_plan_layout_pins_cp_and_refuses_what_cannot_split(capsys):
    from dtrain.cli.main import main

    base = [
        "plan",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--seq",
        "32768",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--json",
    ]
    assert main([*base, "--layout", "cp=4 cp_impl=ulysses"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert (lay["cp"], lay["cp_impl"]) == (4, "ulysses")
    assert main([*base, "--layout", "cp_impl=ring cp=1"]) == 2
    assert "error: --layout: cp_impl=ring needs cp >= 2" in capsys.readouterr().err
    assert main([*base, "--layout", "cp_impl=allgather"]) == 2
    assert "cp_impl='allgather' must be one of ring, ulysses, torch" in capsys.readouterr().err


def test_a_cp_plan_runs_in_the_trainer_as_train_cp():
    lay = Layout(
        dp_shard=2,
        cp=2,
        tp=2,
        zero_stage=3,
        recompute="none",
        micro_batch=1,
        grad_accum=4,
        sequence_parallel=True,
        cp_impl="ulysses",
    )
    out, notes = train_overrides(lay, LLAMA8B_128K, 8)
    assert "world_size=8" in out and "train.cp=2" in out and "train.cp_impl=ulysses" in out
    _, notes = train_overrides(
        Layout(dp_shard=2, cp=2, pp=2, zero_stage=3, recompute="none", micro_batch=1, grad_accum=4),
        LLAMA8B_128K,
        8,
    )
    assert any("refuses cp with pp > 1" in n for n in notes)


def test_torch_cp_all_gathers_the_repeated_kv_once_per_pass():
    """PyTorch's context_parallel (torchtitan's default rotate method, dtrain's
    train.cp_impl=torch): per layer and pass one all-gather of K and V repeated to the rank's
    32/8 query heads, behind the pass's first kernel call; backward sends the fp32 dK, dV chunk
    cp times, the last exposed. tp=8 puts the cp ranks on 4 nodes (one NIC)."""
    from dtrain.costmodel.collectives import all_gather_time, group_link, p2p_time

    cp, m = 4, step_model(LLAMA8B_128K, H100x64, Calibration())
    lay = Layout(
        dp_shard=2,
        cp=cp,
        tp=8,
        zero_stage=3,
        recompute="none",
        micro_batch=1,
        grad_accum=1,
        sequence_parallel=True,
        cp_impl="torch",
    )
    link = group_link(H100x64, cp, 8, multi_rail=False)
    assert link.beta_Bps == H100x64.ib.beta_Bps
    tokens, q = 131072 / cp, 4 * 128
    gather = all_gather_time(cp * 2 * tokens * q * 2, cp, link)
    dkv = p2p_time(2 * tokens * q * 4, link)
    assert m.cp_comm(lay, attention_s=0.0) == pytest.approx(32 * (2 * gather + cp * dkv), rel=1e-12)
    full = Layout(
        dp_shard=2,
        cp=cp,
        tp=8,
        zero_stage=3,
        recompute="full",
        micro_batch=1,
        grad_accum=1,
        sequence_parallel=True,
        cp_impl="torch",
    )  # the recompute gathers again
    assert m.cp_comm(full, 0.0) == pytest.approx(32 * (3 * gather + cp * dkv), rel=1e-12)
    # a forward call of a/(32·4·3.5) hides the gathers and backward sends whenever it outlasts them:
    # the last send is left
    assert m.cp_comm(lay, attention_s=1e3) == pytest.approx(32 * dkv, rel=1e-12)
    assert cp_buffer_bytes(LLAMA8B_128K, lay) == 2 * 2 * 131072 * q  # the gathered K and V, 16-bit


def test_plan_scores_torch_cp_when_asked_and_the_trainer_runs_it(capsys):
    from dtrain.cli.main import main

    base = [
        "plan",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--seq",
        "131072",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--json",
    ]
    assert main(base) == 0
    assert (
        json.loads(capsys.readouterr().out)["choice"]["cp_impl"] != "torch"
    )  # scored, not searched
    assert main([*base, "--layout", "cp=4 cp_impl=torch"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert (lay["cp"], lay["cp_impl"]) == (4, "torch") and "cp=4 torch" in lay["describe"]
    out, _ = train_overrides(
        Layout(
            dp_shard=2,
            cp=4,
            zero_stage=3,
            recompute="none",
            micro_batch=1,
            grad_accum=4,
            cp_impl="torch",
        ),
        LLAMA8B_128K,
        8,
    )
    assert "train.cp=4" in out and "train.cp_impl=torch" in out
