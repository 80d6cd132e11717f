"""One home for each kind of traffic (issue 38): `dtrain.parallel.traffic` holds the bytes per
collective per layer, the trainer's counted collectives add up to them (2 gloo ranks), the cost
model prices those same functions, and Ulysses repeats the k/v heads the way the trainer does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.costmodel.calibration import Calibration, Param
from dtrain.costmodel.collectives import all_to_all_time, group_link, p2p_time
from dtrain.costmodel.hardware import Cluster
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.timemodel import step_model
from dtrain.parallel import traffic

# ---------------------------------------------------------------- the formulas by hand


def test_byte_convention_by_hand():
    assert traffic.wire_bytes("all_reduce", 1000, 4) == 1500  # 2(n-1)/n S
    assert traffic.wire_bytes("all_gather", 1000, 4) == 750
    assert traffic.wire_bytes("all_to_all", 1000, 4) == 750
    assert traffic.wire_bytes("send", 1000, 4) == 1000
    assert traffic.wire_bytes("all_reduce", 1000, 1) == 0


def test_tp_collectives_per_layer_by_recompute():
    """Megatron's 2 per region and pass; full AC re-runs the forward's, op AC wo's unless SP."""
    assert traffic.tp_collectives_per_layer() == 4
    assert traffic.tp_collectives_per_layer("full") == 6
    assert traffic.tp_collectives_per_layer("op") == 5
    assert traffic.tp_collectives_per_layer("op", sequence_parallel=True) == 4
    assert traffic.tp_collectives_per_layer(regions=1) == 2
    assert traffic.tp_activation_bytes(2, 16, 32, 4) == 2 * 16 * 32 * 4


def test_cp_and_pp_and_dp_bytes_by_hand():
    # a ring block: k and v of 2 x 512/4 tokens x 2 heads x 8 dims x 2 B
    assert traffic.ring_kv_block_bytes(2, 512, 4, 2, 8, 2) == 2 * 2 * 128 * 2 * 8 * 2
    assert traffic.ring_sends_per_layer(4) == 9 and traffic.ring_sends_per_layer(4, "full") == 12
    assert traffic.cp_all_gather_kv_bytes(1, 64, 2, 4, 8, 2) == 2 * (2 * 32 * 4 * 8 * 2)
    # Ulysses with 2 k/v heads over cp=4: repeated to lcm(2, 4) = 4 heads
    local = 1 * 16 * 8 * 4
    q, kv = 8 * local, 4 * local
    assert traffic.ulysses_all_to_all_payloads(1, 64, 4, 8, 2, 8, 4) == (q, kv, kv, q)
    assert traffic.ulysses_kv_heads(2, 4) == 4 and traffic.ulysses_kv_heads(3, 2) == 6
    assert traffic.ulysses_kv_heads(8, 4) == 8 and traffic.tp_kv_heads(2, 4) == 1
    assert traffic.ulysses_passes() == 2 and traffic.ulysses_passes("full") == 3
    assert traffic.pp_activation_bytes(2, 128, 64, 2, cp=2, tp=4) == 2 * 64 * 64 * 2 / 4
    assert traffic.pp_sends_per_step(2, 8) == 32
    assert traffic.dp_grad_bytes(1000, 4) == 4000 and traffic.zero_gather_bytes(1000, 2) == 2000
    assert traffic.zero_gather_bytes(1000, 2, kept_params=100) == 900 + 200  # FP8 blocks, bf16 emb
    assert traffic.hsdp_replica_bytes(4000, 8) == 500
    with pytest.raises(ValueError, match="unknown cp impl 'allgather'"):
        traffic.cp_layer_wire_bytes(
            "allgather", batch=1, seq=8, n_head=2, n_kv_head=1, head_dim=4, cp=2
        )


def test_the_trainers_expected_bytes_are_these_functions():
    """The counted-bytes checks (tp-attention's parity, the CP study, the TP bench) compare with
    `expected_wire_bytes`: that name is the traffic module's function, not a copy."""
    from dtrain.parallel import comm_counter
    from dtrain.parallel.cp import exchange
    from dtrain.parallel.tp import tp_collectives

    assert tp_collectives.expected_wire_bytes is traffic.tp_layer_wire_bytes
    assert exchange.expected_wire_bytes is traffic.cp_layer_wire_bytes
    assert exchange.ulysses_kv_heads is traffic.ulysses_kv_heads
    assert comm_counter.wire_bytes is tp_collectives.wire_bytes is traffic.wire_bytes


def test_traffic_module_and_cost_model_import_without_torch():
    code = (
        "import sys; import dtrain.parallel.traffic, dtrain.costmodel.timemodel; "
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# ---------------------------------------------------------------- counted on 2 gloo ranks

COUNTED = r"""
import json, os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])

def rank(r):
    os.environ.update(RANK=str(r), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    from dtrain.model.gpt import GPT, GPTConfig
    from dtrain.parallel.comm_counter import CommCounter
    from dtrain.parallel.cp.ring import ring_attention
    from dtrain.parallel.cp.ulysses import ulysses_attention
    from dtrain.parallel.tp.attention import TensorParallelBlock, make_tp_groups
    from dtrain.parallel.tp.layers import allreduce_partial_grads
    out = {}
    b, s, hd = 2, 16, 8
    for impl, n_head, n_kv in (("ring", 4, 2), ("ulysses", 4, 1)):  # ulysses: 1 k/v head over cp=2
        q = torch.randn(b, n_head, s // 2, hd, requires_grad=True)
        k, v = (torch.randn(b, n_kv, s // 2, hd, requires_grad=True) for _ in range(2))
        fn = ring_attention if impl == "ring" else ulysses_attention
        with CommCounter() as c:
            fn(q, k, v, None).sum().backward()
        out[impl] = [[x.op, x.payload_bytes] for x in c.calls]
    groups = make_tp_groups(2)
    for sp in (False, True):
        cfg = GPTConfig(seq_len=s, n_head=4, n_kv_head=1, d_model=32, n_layer=1, norm="layernorm",
                        bias=True)
        block = TensorParallelBlock.from_full(GPT(cfg).blocks[0], groups, sequence_parallel=sp)
        x = torch.randn(b, s // 2 if sp else s, 32, requires_grad=True)
        with CommCounter() as c:
            block(x).sum().backward()
            allreduce_partial_grads(block)
        out[f"tp_sp{int(sp)}"] = {t: c.wire_bytes(t) for t in ("activation", "grad_sync")}
    if r == 0:
        print(json.dumps(out))
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.start_processes(rank, nprocs=2, start_method="spawn")
"""


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    from dtrain.run.dist import free_port

    script = tmp_path_factory.mktemp("counted") / "counted.py"  # spawn re-imports it by path
    script.write_text(COUNTED)
    r = subprocess.run(
        [sys.executable, str(script), str(free_port())], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_counted_ring_sends_are_the_ring_formulas(counted):
    block = traffic.ring_kv_block_bytes(2, 16, 2, 2, 8, 4)
    sends = [p for op, p in counted["ring"] if op == "send"]
    assert sends == [block] * traffic.ring_sends_per_layer(2)
    assert sum(
        traffic.wire_bytes(op, p, 2) for op, p in counted["ring"]
    ) == traffic.cp_layer_wire_bytes(
        "ring", batch=2, seq=16, n_head=4, n_kv_head=2, head_dim=8, cp=2
    )


def test_counted_ulysses_all_to_alls_repeat_the_kv_heads(counted):
    """One k/v head over cp=2: the trainer repeats it to 2 heads, and so do the payloads."""
    pieces = traffic.ulysses_all_to_all_payloads(2, 16, 2, 4, 1, 8, 4)
    assert pieces[1] == 2 * 8 * 2 * 8 * 4  # 2 k heads, not 1
    a2a = sorted(p for op, p in counted["ulysses"] if op == "all_to_all")
    assert a2a == sorted(list(pieces) * traffic.ulysses_passes())
    assert sum(traffic.wire_bytes("all_to_all", p, 2) for p in a2a) == traffic.cp_layer_wire_bytes(
        "ulysses", batch=2, seq=16, n_head=4, n_kv_head=1, head_dim=8, cp=2
    )


@pytest.mark.parametrize("sp", [False, True])
def test_counted_tp_block_is_the_tp_formulas(counted, sp):
    """LayerNorm with biases and 1 k/v head over tp=2: activation and partial-grad sums."""
    want = traffic.tp_layer_wire_bytes(
        batch=2,
        seq=16,
        d_model=32,
        n_head=4,
        n_kv_head=1,
        tp=2,
        sequence_parallel=sp,
        norm="layernorm",
        bias=True,
    )
    assert counted[f"tp_sp{int(sp)}"] == want
    assert want["activation"] == traffic.tp_collectives_per_layer() * traffic.wire_bytes(
        "all_reduce", traffic.tp_activation_bytes(2, 16, 32, 4), 2
    )


# ---------------------------------------------------------------- the cost model prices the same

LLAMA_GQA2 = ModelShape(32, 4096, 32, 2, 128256, 131072, 3.5, True, name="gqa2")
H100x64 = Cluster.from_profile("h100-sxm", 64, 8)


@pytest.mark.parametrize("tp", [1, 2])
def test_ulysses_prices_the_repeated_kv_heads(tp):
    """2 k/v heads (1 per rank at tp=2) over cp=4 are repeated to 4, as the trainer's
    ulysses_kv_heads does: a pass (forward, backward) is one all-to-all of q, k, v and out's
    bytes, (cp−1) chunks of 1/cp each, α per peer."""
    cp = 4
    m = step_model(LLAMA_GQA2, H100x64, Calibration(cp_overlap=Param(1.0, "measured here: test")))
    lay = Layout(dp_shard=16 // tp, tp=tp, pp=1, zero_stage=3, cp=cp, cp_impl="ulysses")
    link = group_link(H100x64, cp, tp, multi_rail=False)
    tokens, hd = 131072 // cp, 128
    q, kv = tokens * (32 // tp) * hd * 2, tokens * 4 * hd * 2  # 4 k/v heads after the repeat
    per_pass = 3 * ((2 * q + 2 * kv) / 4 / link.beta_Bps + link.alpha_s)
    assert m.cp_comm(lay, attention_s=1e9) == pytest.approx(2 * per_pass * 32, rel=1e-12)


def test_ulysses_uses_the_links_own_all_to_all_fit():
    """A measured all_to_all α–β on the link prices the all-to-alls."""
    shape = ModelShape(2, 64, 4, 4, 256, 64)
    base = H100x64.nvlink
    fitted = type(base)(base.alpha_s, base.beta_Bps, base.name, (("all_to_all", 3e-5, 1e9),))
    from dataclasses import replace

    cluster = replace(H100x64, nvlink=fitted)
    m = step_model(shape, cluster, Calibration())
    lay = Layout(dp_shard=32, tp=1, pp=1, zero_stage=3, cp=2, cp_impl="ulysses")
    pieces = traffic.ulysses_all_to_all_payloads(1, 64, 2, 4, 4, 16, 2)
    want = 2 * (sum(pieces) / 2 / 1e9 + 3e-5) * 2  # 2 passes, 1 peer, 2 layers
    assert m.cp_comm(lay, 0.0) == pytest.approx(want, rel=1e-12)
    assert all_to_all_time(pieces[0], 2, fitted) == pytest.approx(0.5 * pieces[0] / 1e9 + 3e-5)


def test_the_cost_model_calls_the_traffic_functions(monkeypatch):
    """Every kind of traffic the step prices goes through dtrain.parallel.traffic."""
    called = set()
    for name in (
        "tp_activation_bytes",
        "tp_collectives_per_layer",
        "ring_kv_block_bytes",
        "ring_sends_per_layer",
        "ulysses_all_to_all_payloads",
        "dp_grad_bytes",
        "zero_gather_bytes",
        "pp_activation_bytes",
        "pp_sends_per_step",
    ):
        real = getattr(traffic, name)

        def spy(*a, _n=name, _f=real, **k):
            called.add(_n)
            return _f(*a, **k)

        monkeypatch.setattr(traffic, name, spy)
    from dtrain.costmodel import comm_time

    comm_time.dp_comm_time.cache_clear()
    shape = ModelShape(8, 1024, 16, 4, 32000, 8192)
    m = step_model(shape, H100x64, Calibration())
    m.time(Layout(dp_shard=4, tp=2, pp=2, zero_stage=3, grad_accum=4, sequence_parallel=True, cp=2))
    m.time(Layout(dp_shard=4, tp=2, pp=2, zero_stage=3, grad_accum=4, cp=2, cp_impl="ulysses"))
    assert called == {
        "tp_activation_bytes",
        "tp_collectives_per_layer",
        "ring_kv_block_bytes",
        "ring_sends_per_layer",
        "ulysses_all_to_all_payloads",
        "dp_grad_bytes",
        "zero_gather_bytes",
        "pp_activation_bytes",
        "pp_sends_per_step",
    }
    ring = Layout(dp_shard=4, tp=2, pp=2, zero_stage=3, grad_accum=4, cp=2)
    link = group_link(H100x64, 2, 2, multi_rail=False)
    chunk = traffic.ring_kv_block_bytes(1, 8192, 2, traffic.tp_kv_heads(4, 2), 64, 2)
    sends = traffic.ring_sends_per_layer(2) * p2p_time(chunk, link) * 4 * 4
    assert m.cp_comm(ring, 0.0) == pytest.approx(sends, rel=1e-12)
