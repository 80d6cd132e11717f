"""dtrain.costmodel: formulas against hand calculations, and properties of the chooser."""

import pytest

from conftest import py

from dtrain.costmodel import (
    Calibration,
    Cluster,
    Layout,
    LinkModel,
    ModelShape,
    Param,
    all_gather_time,
    allreduce_time,
    bubble_fraction,
    explain,
    get_profile,
    group_link,
    load_profiles,
    memory_per_gpu,
    model_state_bytes,
    p2p_time,
    params_per_gpu,
    reduce_scatter_time,
    search,
    step_time,
)
from dtrain.costmodel.activations import activation_bytes_per_layer
from dtrain.costmodel.search import Plan, SearchResult

GiB = 1024**3


# ---------------------------------------------------------------- hardware profiles


def test_profiles_load_with_sources_and_dense_peaks():
    profiles = load_profiles()
    assert set(profiles) == {
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h100-pcie",
        "h100-nvl",
        "h200",
        "b200",
        "b300",
        "gb200",
        "gb300",
        "h800",
        "h20",
    }
    for p in profiles.values():
        assert "NVIDIA" in p.source
        assert p.nvlink_gbps_bidir == 2 * p.nvlink_gbps_per_dir
    h100 = profiles["h100-sxm"]
    assert h100.peak_bf16_flops == pytest.approx(989.4e12)  # dense, not the 1,979 sparse figure
    assert h100.nvlink_Bps == 450e9  # the per-direction figure is the one the model uses
    assert h100.ib_Bps == 50e9  # 400 Gbit/s
    assert profiles["a100-40gb"].peak_fp8_flops is None
    assert profiles["a100-80gb"].fp8_tflops is None
    assert profiles["h200"].hbm_bytes == 141 * GiB


def test_unknown_gpu_error_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown GPU 'v100'.*a100-40gb.*h100-sxm"):
        get_profile("v100")


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize(
    "stage, expected",
    [
        (0, 18 * 7e9),  # Megatron: 18 bytes/param (fp32 main grads)
        (1, (6 + 12 / 64) * 7e9),  # Megatron distributed optimizer: 6 + 12/d
        (
            2,
            2 * 7e9 + 16 * 7e9 / 64,
        ),  # bf16 weights replicated, fp32 grads + Adam sharded: 2Ψ + 16Ψ/N
        (3, 16 * 7e9 / 64),  # FSDP2: fp32 master weights, fp32 grads, m, v sharded: 16Ψ/N
    ],
)
def test_zero_model_states_7b_on_64_gpus(stage, expected):
    params, grads, optimizer = model_state_bytes(7e9, stage, 64)
    assert params + grads + optimizer == pytest.approx(expected, rel=1e-12)


def test_zero_components():
    psi, nd = 7e9, 64
    assert model_state_bytes(psi, 0, nd) == pytest.approx((2 * psi, 4 * psi, 12 * psi))
    assert model_state_bytes(psi, 2, nd) == pytest.approx((2 * psi, 4 * psi / nd, 12 * psi / nd))
    assert model_state_bytes(psi, 3, nd) == pytest.approx(
        (4 * psi / nd, 4 * psi / nd, 8 * psi / nd)
    )


def test_gpt_param_count_and_tp_pp_division():
    gpt2 = ModelShape(12, 768, 12, 12, 50257, 1024, tied_embeddings=True)
    assert (
        gpt2.num_params() == 12 * (12 * 768**2 + 2 * 768) + 50257 * 768 + 768
    )  # ~124M (GPT-2 small)
    # 2 stages x 4-way TP: each stage holds 6 layers / 4 plus one V*h embedding / 4.
    assert params_per_gpu(gpt2, tp=4, pp=2) == pytest.approx(
        (6 * (12 * 768**2 + 2 * 768) + 50257 * 768) / 4
    )
    layout = Layout(dp_shard=8, tp=4, pp=2, zero_stage=3)
    psi = params_per_gpu(gpt2, 4, 2)
    assert memory_per_gpu(gpt2, layout).params == pytest.approx(
        4 * psi / 8
    )  # FSDP2: fp32 sharded master weights
    # under PP the stage keeps its bf16 weights gathered (2 psi) and FSDP2 accumulates its unsharded
    # gradients in the fp32 reduce dtype until the last micro-batch syncs them
    # (FSDPParam.to_accumulated_grad_if_needed)
    assert memory_per_gpu(gpt2, layout).buffers == pytest.approx(2 * psi + 4 * psi)


def test_from_params_uses_known_shapes_and_interpolates():
    llama70 = ModelShape.from_params(70e9, seq_len=2048)
    assert (llama70.n_layer, llama70.d_model, llama70.n_kv_head, llama70.seq_len) == (
        80,
        8192,
        8,
        2048,
    )
    # Llama 3 70B (the guide's 70B): its 128256-token vocabulary, 70.6e9 parameters
    assert (llama70.name, llama70.vocab, llama70.ffn_hidden) == ("Llama-3-70B", 128256, 28672)
    assert llama70.num_params() == pytest.approx(70.6e9, rel=0.001)
    llama8 = ModelShape.from_params(8e9)
    assert (llama8.n_layer, llama8.d_model, llama8.n_kv_head, llama8.ffn_hidden) == (
        32,
        4096,
        8,
        14336,
    )
    assert llama8.num_params() == pytest.approx(8.03e9, rel=0.001)
    assert ModelShape.from_params(7e9).name == "Llama-2-7B"  # Llama 3 has no 7B: Llama 2 kept
    for target in (3e9, 20e9, 120e9, 250e9, 60e6, 200e6, 500e6):
        assert ModelShape.from_params(target).num_params() == pytest.approx(target, rel=0.05)
    # below 1B: GPT-3's small models (Brown et al. 2020, Table 2.1), not a Llama-vocabulary shape
    # whose embedding would leave 125M parameters one layer
    small = ModelShape.from_params(125e6, seq_len=2048)
    assert (small.n_layer, small.d_model, small.n_head, small.vocab, small.rotary) == (
        12,
        768,
        12,
        50257,
        False,
    )
    assert small.num_params() == pytest.approx(
        125e6, rel=0.02
    )  # learned positions (1.6M) not counted
    assert [(s.n_layer, s.d_model) for s in map(ModelShape.from_params, (350e6, 760e6))] == [
        (24, 1024),
        (24, 1536),
    ]
    assert ModelShape.from_params(200e6).n_layer >= 6


S, B, H, A, T = 2048, 4, 4096, 32, 8


@pytest.mark.parametrize(
    "t, sp, recompute, expected",
    [
        (1, False, "none", S * B * H * (34 + 5 * A * S / H)),
        (T, False, "none", S * B * H * (10 + 24 / T + 5 * A * S / (H * T))),
        (T, True, "none", S * B * H / T * (34 + 5 * A * S / H)),
        (T, False, "selective", S * B * H * (10 + 24 / T)),
        (T, True, "selective", S * B * H / T * 34),
        (1, False, "full", 2 * S * B * H),
        (T, False, "full", 2 * S * B * H),
        (T, True, "full", 2 * S * B * H / T),
    ],
)
def test_activation_formulas_korthikanti(t, sp, recompute, expected):
    got = activation_bytes_per_layer(S, B, H, A, t, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


def test_flash_attention_drops_the_score_term():
    with_fa = activation_bytes_per_layer(S, B, H, A, T, True, "none", flash_attention=True)
    assert with_fa == activation_bytes_per_layer(S, B, H, A, T, True, "selective")


def test_pipeline_first_stage_holds_pp_microbatches():
    shape = ModelShape(8, 1024, 8, 8, 1000, 512)
    one = memory_per_gpu(shape, Layout(grad_accum=8)).activations
    per_layer = activation_bytes_per_layer(
        512, 1, 1024, 8, flash_attention=True, dropout=False
    )  # no dropout
    output = 4 * 512 * (1024 + 1000)  # output layer input + fp32 logits (Megatron's count)
    ids = 8 * 512  # the embedding's token ids, per micro-batch in flight
    temporaries = 1.05  # without SP (Megatron's precise count)
    assert one == pytest.approx((8 * per_layer + ids + output) * temporaries)
    four = memory_per_gpu(shape, Layout(pp=4, grad_accum=8)).activations
    # first stage: 2 layers, 4 micro-batches in flight (its last stage holds one and the logits:
    # less)
    assert four == pytest.approx((2 * per_layer * 4 + 4 * ids) * temporaries)
    gpipe = memory_per_gpu(shape, Layout(pp=4, grad_accum=8, pp_schedule="gpipe")).activations
    assert gpipe == pytest.approx((2 * per_layer * 8 + 8 * ids) * temporaries)  # GPipe holds all 8


def test_memory_breakdown_fits():
    from dtrain.costmodel import MemoryBreakdown

    m = MemoryBreakdown(params=10 * GiB, grads=10 * GiB, optimizer=40 * GiB, activations=10 * GiB)
    assert m.total == 70 * GiB
    assert m.fits(80 * GiB, headroom=0.1) and not m.fits(80 * GiB, headroom=0.2)


# ---------------------------------------------------------------- time model


def test_collective_formulas_by_hand():
    link = LinkModel(alpha_s=5e-6, beta_Bps=100e9)
    nbytes, n = 2**30, 8
    assert allreduce_time(nbytes, n, link) == pytest.approx(2 * 7 / 8 * 2**30 / 100e9 + 14 * 5e-6)
    assert all_gather_time(nbytes, n, link) == pytest.approx(7 / 8 * 2**30 / 100e9 + 7 * 5e-6)
    assert reduce_scatter_time(nbytes, n, link) == all_gather_time(nbytes, n, link)
    assert p2p_time(nbytes, link) == pytest.approx(2**30 / 100e9 + 5e-6)
    assert allreduce_time(nbytes, 1, link) == 0.0


@pytest.mark.parametrize(
    "p, m, v, expected", [(4, 8, 1, 3 / 8), (4, 8, 2, 3 / 16), (8, 32, 4, 7 / 128), (1, 4, 1, 0.0)]
)
def test_bubble_fraction(p, m, v, expected):
    assert bubble_fraction(p, m, v) == pytest.approx(expected)


def _cluster(gpus=64, ib_alpha=5e-6):
    return Cluster(
        gpus,
        8,
        get_profile("h100-sxm"),
        LinkModel(1e-6, 450e9, "NVLink"),
        LinkModel(ib_alpha, 50e9, "IB"),
    )


def test_step_time_bubble_and_total():
    shape = ModelShape.from_params(7e9)
    for pp, m, v in [(2, 8, 1), (4, 8, 2), (8, 16, 4)]:
        t = step_time(
            shape,
            Layout(dp_shard=64 // (2 * pp), tp=2, pp=pp, grad_accum=m, pp_virtual=v),
            _cluster(),
        )
        assert t.bubble == pytest.approx(
            (pp - 1) / (v * m) * (t.compute - t.terms.optimizer + t.tp_comm)
        )
        assert t.total == pytest.approx(
            t.compute + t.tp_comm + t.pp_comm + t.bubble + t.dp_comm_exposed
        )
        assert t.mfu == pytest.approx(t.model_flops / (t.total * 64 * 989.4e12))


def test_dp_volumes_fp32_grads_bf16_weights():
    shape, cluster = ModelShape.from_params(7e9), _cluster(ib_alpha=0.0)
    no_overlap = Calibration(dp_overlap=Param(0.0, "measured here: test"))
    psi, beta, f = shape.num_params(), 400e9, 63 / 64  # 8 rails x 50 GB/s
    dp = step_time(shape, Layout(dp_shard=64, zero_stage=0), cluster, no_overlap).dp_comm
    z1 = step_time(shape, Layout(dp_shard=64, zero_stage=1), cluster, no_overlap).dp_comm
    z3 = step_time(shape, Layout(dp_shard=64, zero_stage=3), cluster, no_overlap).dp_comm
    assert dp == pytest.approx(2 * f * 4 * psi / beta)  # all-reduce of fp32 grads
    assert z1 == pytest.approx(
        f * 4 * psi / beta + f * 2 * psi / beta
    )  # reduce-scatter fp32 + all-gather bf16
    assert z3 == pytest.approx(2 * f * 2 * psi / beta + f * 4 * psi / beta)


def test_recompute_costs_extra_forward():
    """Full recompute re-runs every layer's forward (GEMMs, attention forward, the forward's
    memory-bound passes); selective the attention forward alone; no recompute none of it."""
    from dtrain.costmodel.attention_time import attention_s
    from dtrain.costmodel.memory_bound import (
        FORWARD_SHARE,
        MEMORY_KIND,
        memory_bytes,
        memory_widths,
    )
    from dtrain.costmodel.efficiency import layer_gemms
    from dtrain.costmodel.stack import Stack
    from dtrain.costmodel.device_rates import device_of

    shape, cluster = ModelShape.from_params(7e9), _cluster()
    dev = device_of(cluster, Calibration(), Stack("eager"))
    lay = Layout(dp_shard=64)
    fwd = sum(dev.gemm_s(g) for g in layer_gemms(shape, lay) if g.name not in ("scores", "av"))
    widths = memory_widths(shape, lay)  # each kind at its rows' width (kernels.yaml by_width)
    mem_fwd = sum(
        dev.mem_s(b, MEMORY_KIND[k], widths.get(k)) * FORWARD_SHARE[k]
        for k, b in memory_bytes(shape, lay, "bf16", True).items()
    )
    L = shape.n_layer

    def t(rc):
        layout = Layout(dp_shard=64, recompute=rc)
        return step_time(shape, layout, cluster, stack=Stack("eager")).terms

    base = t("none")
    assert base.recompute == 0 and base.gemm == pytest.approx(
        L * 3 * fwd
    )  # forward + dgrad + wgrad
    assert t("full").recompute == pytest.approx(
        L * (fwd + attention_s(shape, lay, dev, True) + mem_fwd)
    )
    assert t("selective").recompute == pytest.approx(L * attention_s(shape, lay, dev, True))


def test_links_nvlink_inside_node_ib_across():
    c = _cluster()
    assert group_link(c, 8, 1) == c.nvlink
    assert group_link(c, 16, 1, multi_rail=False).beta_Bps == 50e9  # TP across nodes: one NIC
    assert group_link(c, 16, 4).beta_Bps == 100e9  # DP, 2 members per node -> 2 rails


def test_calibration_provenance_is_checked():
    assert all(
        getattr(Calibration(), f).provenance.startswith("datasheet/published:")
        for f in ("mfu", "dp_overlap", "tp_overhead", "fp8_speedup", "fp8_memory_factor")
    )
    assert Param(0.41, "measured here: results/fsdp-scaling/run1").measured
    with pytest.raises(ValueError, match="provenance"):
        Param(0.5, "I think so")


def test_fp8_on_a100_is_refused():
    shape = ModelShape.from_params(7e9)
    with pytest.raises(ValueError, match="no FP8"):
        search(shape, Cluster.from_profile("a100-80gb", 8), 64, precision="fp8")


# ---------------------------------------------------------------- search

GRID_MODELS = (1e9, 7e9, 13e9, 70e9, 405e9)
GRID_CLUSTERS = (
    ("a100-40gb", 8),
    ("a100-80gb", 64),
    ("h100-sxm", 8),
    ("h100-sxm", 256),
    ("h200", 64),
    ("b200", 16),
    ("h100-pcie", 16),
)


@pytest.mark.parametrize("gpu, gpus", GRID_CLUSTERS)
def test_chooser_never_exceeds_capacity(gpu, gpus):
    cluster = Cluster.from_profile(gpu, gpus)
    for params in GRID_MODELS:
        shape = ModelShape.from_params(params)
        res = search(shape, cluster, global_batch=256, headroom=0.1)
        usable = cluster.gpu.hbm_bytes * 0.9
        for plan in res.ranked:
            assert plan.dp * plan.tp * plan.pp == gpus
            assert plan.dp * plan.micro_batch * plan.grad_accum == 256
            again = memory_per_gpu(shape, plan).total  # recomputed, not the stored number
            assert again == pytest.approx(plan.memory.total) and again <= usable
        assert (res.best is None) == (not res.ranked)


def test_nothing_fits_gives_reason_not_exception():
    res = search(
        ModelShape.from_params(405e9), Cluster.from_profile("a100-40gb", 8), global_batch=64
    )
    assert res.best is None and res.ranked == []
    assert res.reason.startswith("does not fit") and "GiB" in res.reason
    assert explain(res) == [res.reason]


def test_7b_on_one_h100_node_prefers_no_pipeline():
    res = search(ModelShape.from_params(7e9), Cluster.from_profile("h100-sxm", 8), global_batch=64)
    assert res.best is not None and res.best.tp <= 8 and res.best.pp == 1


def test_explain_names_cross_node_tp_and_memory_rejections():
    shape, cluster = ModelShape.from_params(70e9), _cluster(64)
    plans = []
    for tp in (8, 16):
        lay = Layout(
            dp_shard=64 // tp, tp=tp, zero_stage=3, recompute="full", grad_accum=tp
        )  # batch 64
        mem, time = memory_per_gpu(shape, lay), step_time(shape, lay, cluster)
        plans.append(Plan(**vars(lay), memory=mem, time=time))
    plans.sort(key=lambda p: -p.time.tokens_per_s)
    too_big = Layout(
        dp_shard=64, zero_stage=0, grad_accum=1
    )  # plain DP: faster, but 16 bytes/param
    assert step_time(shape, too_big, cluster).tokens_per_s > plans[0].time.tokens_per_s
    res = SearchResult(plans[0], plans, [(too_big, "does not fit: test")], "", shape, cluster, 64)
    lines = explain(res)
    assert plans[0].tp == 8
    assert any("tp=16 crosses nodes: TP all-reduce over IB" in line for line in lines)
    assert any(
        "dp=64 tp=1 pp=1" in line and "does not fit" in line and "GiB > 72.0 GiB" in line
        for line in lines
    )
    # --top 0: the choice alone, no runner-up or too-big design (k = 0 used to list every runner-up)
    assert explain(res, 0) == lines[:1]
    assert len(explain(res, 1)) == 3 and explain(res, 1)[1].startswith("dp=4 tp=16")


def test_global_batch_not_divisible_is_reported():
    res = search(ModelShape.from_params(1e9), Cluster.from_profile("h100-sxm", 8), global_batch=3)
    assert any("not a multiple" in why for _, why in res.rejected_with_reasons)
    assert (
        res.best.dp == 1 and res.best.micro_batch * res.best.grad_accum == 3
    )  # only dp=1 divides 3


FSDP2_ACCUMULATION = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# as a pipeline stage under torchtitan and dtrain: gathered across micro-batches, no sync
for block in model:
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
model[0].set_requires_gradient_sync(False)
for _ in range(2):
    model(torch.randn(4, 64)).sum().backward()
for p in model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params:
    print(p._unsharded_param.dtype, p.unsharded_accumulated_grad.dtype)
dist.destroy_process_group()
"""


def test_fsdp2_accumulates_unsharded_grads_in_the_reduce_dtype():
    """The 6 psi of ZeRO-3 under PP, checked against PyTorch itself: between gradient syncs FSDP2
    keeps the gathered bf16 weights (2 B/param) and the accumulated unsharded gradients in fp32
    (4 B/param)."""
    from dtrain.run.dist import free_port

    r = py("-c", FSDP2_ACCUMULATION, str(free_port()), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["torch.bfloat16 torch.float32"] * 2


def test_in_flight_micro_batches_by_schedule():
    """The first stage's peak: 1F1B min(pp, m); interleaved x (1 + (pp-1)/(pp v)) but never more
    than the m micro-batches there are (pp=8, v=2, m=8: the warm-up's 2*7 + 8 = 22 chunk forwards
    cover all 16); GPipe m."""
    from dtrain.costmodel.activations import in_flight

    assert in_flight(Layout(pp=8, grad_accum=32)) == 8
    assert in_flight(Layout(pp=8, grad_accum=4)) == 4
    assert in_flight(Layout(pp=8, grad_accum=32, pp_virtual=2)) == pytest.approx(8 * (1 + 7 / 16))
    assert in_flight(Layout(pp=8, grad_accum=8, pp_virtual=2)) == 8
    assert in_flight(Layout(pp=8, grad_accum=32, pp_schedule="gpipe")) == 32
    assert in_flight(Layout(dp_shard=8, grad_accum=32)) == 1
