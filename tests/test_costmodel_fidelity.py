"""Issue 12: cost-model formulas against hand calculations from their cited sources."""

from dataclasses import replace
import json
import subprocess
import sys

import pytest

from dtrain.costmodel import Layout, ModelShape, bubble_fraction, memory_per_gpu, params_per_gpu
from dtrain.costmodel.backtest import backtest, summary
from dtrain.costmodel.backtest_cli import text_lines
from dtrain.costmodel.efficiency import GemmCurve, fit_curve
from dtrain.costmodel.activations import activation_bytes_per_layer
from dtrain.costmodel.token_flops import model_flops_per_token
from dtrain.model.gpt import GPTConfig, flops_per_token
from dtrain.results import contract, contract_records

GiB = 1024**3


def test_tied_embedding_flops_equal_model_py():
    cfg = GPTConfig.from_preset("125m")
    shape = ModelShape(
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.vocab_size,
        cfg.seq_len,
        float(cfg.mlp_ratio),
        False,
        True,
    )
    # 6 * (12 layers * 12 h^2 + V h [lm_head, kept though tied]) + 12 L h s
    h, L, V, s = 768, 12, 50304, 1024
    hand = 6 * (L * 12 * h * h + V * h) + 12 * L * h * s
    assert model_flops_per_token(shape) == flops_per_token(cfg) == hand
    assert hand / 1e9 == pytest.approx(0.8547, abs=1e-4)


def test_uneven_interleaved_bubble():
    # 126 layers on 16 stages x 3 chunks: busiest chunk ceil(126/48) = 3 layers, busiest device 8
    assert bubble_fraction(16, 32, 3, 126) == pytest.approx(15 * 3 / (32 * 8))
    # v = 8: 128 chunks of at most one layer -> the even formula 15 / (8 * 32)
    assert bubble_fraction(16, 32, 8, 126) == pytest.approx(15 / (8 * 32))
    assert bubble_fraction(4, 8, 2, 32) == pytest.approx(bubble_fraction(4, 8, 2))


def test_activations_gqa_swiglu_by_hand():
    s, b, h, a, t = 4096, 1, 8192, 64, 8
    # Llama-3-70B: 8 KV heads (r = 1/8), SwiGLU with F = 3.5 h (3 stored F-wide tensors), TP 8 + SP
    got = activation_bytes_per_layer(
        s, b, h, a, t, True, "none", True, ffn_mult=3.5, gated_mlp=True, kv_ratio=1 / 8
    )
    assert got == pytest.approx(s * b * h / t * (10 + 4 + 4 / 8 + 2 * 3.5 * 3))
    eager = activation_bytes_per_layer(
        s, b, h, a, t, True, "none", False, ffn_mult=3.5, gated_mlp=True, kv_ratio=1 / 8
    )
    assert eager - got == pytest.approx(s * b * h / t * 5 * a * s / h)  # Korthikanti's score term
    sel = activation_bytes_per_layer(
        s, b, h, a, t, True, "selective", False, ffn_mult=3.5, gated_mlp=True, kv_ratio=1 / 8
    )
    assert sel == pytest.approx(got)  # selective recompute removes exactly the scores


def test_memory_per_stage_fp32_grads_and_full_recompute_working_set():
    shape = ModelShape.from_params(70e9)  # Llama-3-70B, 80 layers
    lay = Layout(dp_shard=4, tp=2, pp=8, zero_stage=1, grad_accum=16, sequence_parallel=True)
    psi = params_per_gpu(shape, 2, 8)
    m = memory_per_gpu(shape, lay)
    assert (m.params, m.grads, m.optimizer) == pytest.approx((2 * psi, 4 * psi, 12 * psi / 4))
    full = memory_per_gpu(
        shape,
        Layout(
            dp_shard=4,
            tp=2,
            pp=8,
            zero_stage=1,
            recompute="full",
            grad_accum=16,
            sequence_parallel=True,
        ),
    )
    kw = dict(ffn_mult=shape.ffn_hidden / shape.d_model, gated_mlp=True, kv_ratio=8 / 64)
    stored = activation_bytes_per_layer(4096, 1, 8192, 64, 2, True, "full", True, **kw)
    working = activation_bytes_per_layer(
        4096, 1, 8192, 64, 2, True, "none", True, **kw, dropout=False
    )
    assert stored == 2 * 4096 * 8192 / 2
    # first stage: 10 layers x 8 micro-batches in flight of layer inputs + one layer's full working
    # set + the embedding's token ids of each micro-batch in flight (8 bytes each, Megatron's count)
    assert full.activations == pytest.approx(10 * 8 * stored + working + 8 * 8 * 4096 / 2)


def test_fit_curve_recovers_parameters():
    truth = GemmCurve(0.8, 3e9)
    pts = [(w, truth.fraction(w)) for w in (1e8, 1e9, 1e10, 1e11)]
    got = fit_curve(pts)
    assert (got.e_max, got.w_half) == pytest.approx((0.8, 3e9), rel=1e-6)


def test_backtest_rows_cite_sources_and_report_goals():
    rows = backtest(rank=False)
    assert len(rows) >= 40 and all(r.source and r.group for r in rows)
    assert all(r.reported_tps > 0 for r in rows if not r.expect_oom)
    s = summary(rows)
    assert s["rows"] == sum(not r.expect_oom for r in rows) and 0 <= s["median_abs_error"] < 1
    # a TFLOP/s row is converted with its source's FLOP count: SC'21 eq. (3) counts the recompute
    # forward
    from dtrain.costmodel.published_runs import load_rows, reported_tps, row_setup

    [row] = [r for r in load_rows() if r["name"].startswith("Megatron SC'21 1.7B")]
    n_layer, h, s_, v = 24, 2304, 2048, 51200
    assert reported_tps(row, row_setup(row).shape) == pytest.approx(
        137e12 / (96 * n_layer * h * h * (1 + s_ / (6 * h) + v / (16 * n_layer * h)))
    )
    # a source's reported peak memory (torchtitan's table) is read and compared with the prediction
    [tt] = [r for r in rows if r.name == "torchtitan Llama 3.1 8B, FSDP, 8 H100"]
    assert tt.reported_memory_gib == 82.4 and tt.memory_error == pytest.approx(
        tt.memory_gib / 82.4 - 1
    )
    mem = sorted(r.memory_error for r in rows if r.reported_memory_gib)
    assert s["memory_rows"] == len(mem) == 18 and s["memory_error_range"] == (mem[0], mem[-1])
    assert any("(82.4)" in line for line in text_lines(rows))
    # the footer says how the rows were predicted, and that an unranked table has no gap figure
    loso, in_sample = "\n".join(text_lines(rows)), "\n".join(text_lines(rows, loso=False))
    assert "fitted on the OTHER sources (leave-one-source-out)" in loso and "OTHER" not in in_sample
    assert (
        "fitted to every row (in sample)" in in_sample and "layouts not ranked (--no-rank)" in loso
    )
    assert "within 10% of the best" not in loso


def _plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli.main", "plan", *args], capture_output=True, text=True
    )


def test_plan_layout_json_reports_gap_and_tflops():
    r = _plan("--params", "70e9", "--gpus", "64", "--layout", "tp=8 pp=2 zero=1 mb=1", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    lay = d["layout"]
    assert (lay["tp"], lay["pp"], lay["zero_stage"], lay["micro_batch"]) == (8, 2, 1, 1)
    assert lay["slower_than_best_pct"] >= 0 and lay["tflops_per_gpu"] > 0
    assert lay["tflops_per_gpu"] == pytest.approx(
        lay["tokens_per_s"] * model_flops_per_token(ModelShape.from_params(70e9)) / 64 / 1e12
    )


def test_plan_bad_layout_is_a_user_error():
    r = _plan("--params", "7e9", "--gpus", "8", "--layout", "tp=8 foo=2")
    assert r.returncode == 2 and r.stderr.startswith("error: --layout: 'foo=2'")


def test_gemm_probe_run_calibrates_the_local_check(tmp_path):
    """The probe writes a run dir that calibrate reads; the local check then uses its curve +
    overhead."""
    import shutil

    from dtrain.costmodel.calibrate import calibrate
    from dtrain.costmodel.gemm_probe import probe
    from dtrain.guide.local_check import local_checks

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    print("seed 0")
    res = tmp_path / "results"
    shutil.copytree("tests/fixtures/results/cpu", res)
    out = probe(res)
    summary = json.loads((out / "summary.json").read_text())
    [g] = contract.read(summary)
    assert isinstance(g, contract_records.GemmProbe) and g.points and g.overheads and g.e_max > 0
    assert all(
        p.seconds > 0 and p.fraction == pytest.approx(p.flops / p.seconds / g.peak_flops)
        for p in g.points
    )
    # a derived run: it names the runs whose models it probed (those that publish training / TP
    # records)
    assert sorted(p.name for p in contract.derived_from(summary, out)) == [
        "20250301-100100-000000",
        "20250301-100100-000001",
        "20250301-100200-000000",
        "20250301-100300-000000",
    ]
    report = calibrate([res], warn=False)
    assert report.local_probe() is not None
    assert report.local.mfu.value == pytest.approx(g.e_max) and report.local.mfu.measured
    checks = local_checks(report)
    assert any("gemm-probe" in c.basis for c in checks)
    assert all(c.within_goal or c.miss_reason(checks) for c in checks)  # every miss says why


def test_activations_without_dropout_by_hand():
    # Korthikanti §4.1 without dropout: the two 1-byte masks (attention out, MLP out) leave 8 of the
    # replicated 10; the score term keeps only the softmax output, 2·a·s/h of 5·a·s/h.
    s, b, h, a = 2048, 1, 4096, 32
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a, dropout=True) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, dropout=False) == sbh * (32 + 2 * a * s / h)
    # TP 4 without SP: replicated 8, sharded (24 + 2as/h)/t
    assert activation_bytes_per_layer(s, b, h, a, 4, dropout=False) == sbh * (
        8 + (24 + 2 * a * s / h) / 4
    )
    # Llama-3-70B shard (GQA 1/8, SwiGLU 3.5h, TP 8 + SP, FlashAttention): 8 + 4 + 0.5 + 21 = 33.5 /
    # 8
    got = activation_bytes_per_layer(
        4096,
        1,
        8192,
        64,
        8,
        True,
        "none",
        True,
        ffn_mult=3.5,
        gated_mlp=True,
        kv_ratio=1 / 8,
        dropout=False,
    )
    assert got == 4096 * 8192 / 8 * 33.5
    # full recompute stores only the layer input, dropout or not
    assert activation_bytes_per_layer(s, b, h, a, recompute="full", dropout=False) == 2 * sbh


def test_model_shape_dropout_reaches_memory():
    llama = ModelShape.from_params(70e9)
    assert not llama.dropout and ModelShape.from_params(175e9).dropout
    lay = Layout(tp=8, sequence_parallel=True)
    with_dropout = memory_per_gpu(replace(llama, dropout=True), lay).activations
    no_dropout = memory_per_gpu(llama, lay).activations
    # one layer's difference is 2·s·b·h/t bytes (the two masks), and the embedding's dropout mask
    # s·b·h/t
    assert with_dropout - no_dropout == pytest.approx(80 * 2 * 4096 * 8192 / 8 + 4096 * 8192 / 8)


def test_backtest_leave_one_source_out_never_uses_the_source_itself():
    from dtrain.costmodel.backtest_fit import fit, loso_fits
    from dtrain.costmodel.published_runs import load_rows

    rows = list(load_rows())
    fits = loso_fits(tuple(rows))
    assert set(fits) == {r["group"] for r in rows}
    g = "megatron-sc21"
    assert fits[g] == fit([r for r in rows if r["group"] != g])
    # changing that source's reported numbers never moves its own fit
    scaled = [
        dict(
            r,
            reported={
                "tflops_per_gpu": r["reported"]["tflops_per_gpu"] * 3,
                "flops": "megatron_recompute",
            },
        )
        if r["group"] == g
        else r
        for r in rows
    ]
    assert loso_fits(tuple(scaled))[g] == fits[g]


def test_zero3_pays_latency_per_fsdp_unit_by_hand():
    from dtrain.costmodel import LinkModel, step_time
    from dtrain.guide.local_host import host_cluster

    shape = ModelShape(6, 512, 8, 8, 1000, 128)
    alpha, beta = 1e-3, 1e9
    cluster = host_cluster(1e11, 2, LinkModel(alpha, beta))
    t = step_time(shape, Layout(dp_shard=2, zero_stage=3), cluster)
    psi = params_per_gpu(shape, 1, 1)
    ag = 0.5 * 2 * psi / beta + alpha  # bf16 weights, ring all-gather over 2 ranks
    rs = 0.5 * 4 * psi / beta + alpha  # fp32 grads, reduce-scatter
    per_unit = 6 * alpha  # 6 blocks + the root = 7 FSDP units: 6 more latencies per collective
    assert t.dp_comm == pytest.approx(2 * (ag + per_unit) + rs + per_unit)
    # ZeRO-1 keeps one collective of each kind per step
    z1 = step_time(shape, Layout(dp_shard=2, zero_stage=1), cluster)
    assert z1.dp_comm == pytest.approx(ag + rs)


def test_fsdp_under_pp_reduces_after_the_last_backward_by_hand():
    """Once-per-step DP traffic under PP (4 stages of a 6-layer model, 2 micro-batches): ZeRO-1
    (Megatron's --overlap-grad-reduce) overlaps its gradient reduce-scatter with the last
    micro-batch's backward (2/3 of one micro-batch) and half the bubble; ZeRO-3, which
    torch.distributed.pipelining runs as FSDP's post-backward after the stage's last backward,
    overlaps none of it. Both overlap the weight all-gather with the first forward (1/3 of a
    micro-batch). What overlaps still costs 1 − dp_overlap of its time (no kernel table: no HBM
    term)."""
    from dtrain.costmodel import LinkModel, step_time
    from dtrain.costmodel.calibration import Calibration
    from dtrain.guide.local_host import host_cluster

    shape = ModelShape(6, 512, 8, 8, 1000, 128)
    cluster = host_cluster(1e11, 8, LinkModel(1e-5, 1e8))
    calib = Calibration()
    ov = calib.dp_overlap.value
    for zero in (1, 3):
        t = step_time(
            shape, Layout(dp_shard=2, pp=4, zero_stage=zero, grad_accum=2), cluster, calib
        )
        psi = params_per_gpu(shape, 1, 4)
        rs, ag = (
            0.5 * 4 * psi / 1e8 + 1e-5,
            0.5 * 2 * psi / 1e8 + 1e-5,
        )  # ring over 2 ranks: fp32 grads, bf16 weights
        assert t.dp_comm == pytest.approx(rs + ag)
        micro = (t.compute - t.terms.optimizer) / 2
        window = 2 / 3 * micro + t.bubble / 2 if zero == 1 else 0.0
        hidden = ov * (min(rs, window) + min(ag, micro / 3))
        loss = t.dp_comm_exposed - (rs + ag - hidden)
        assert 0 <= loss < 1e-3  # the step's loss all-reduce: one latency-bound message
    z1 = step_time(shape, Layout(dp_shard=2, pp=4, zero_stage=1, grad_accum=2), cluster, calib)
    z3 = step_time(shape, Layout(dp_shard=2, pp=4, zero_stage=3, grad_accum=2), cluster, calib)
    assert z3.dp_comm == pytest.approx(z1.dp_comm) and z3.dp_comm_exposed > z1.dp_comm_exposed


def test_overlapped_dp_traffic_costs_its_sms_and_its_rings_hbm_by_hand():
    """FSDP (ZeRO-3, no PP) behind a longer compute: the exposed DP time is the overlap cost x
    the traffic, the SM share 1 − dp_overlap plus 3 x β / HBM of the group's link
    (collectives.overlap_cost). A ring over NVLink (8 ranks in a node) pays far more of its time
    than one over a NIC (16 ranks a node apart, TP 8 inside)."""
    from dtrain.costmodel import step_time
    from dtrain.costmodel.calibration import Calibration
    from dtrain.costmodel.collectives import group_link
    from dtrain.costmodel.hardware import Cluster

    calib = Calibration()
    shape = ModelShape.from_params(70e9)
    for gpus, lay in (
        (8, Layout(dp_shard=8, zero_stage=3, recompute="full", micro_batch=16)),
        (
            128,
            Layout(
                dp_shard=16,
                tp=8,
                zero_stage=3,
                recompute="full",
                micro_batch=16,
                sequence_parallel=True,
            ),
        ),
    ):
        cluster = Cluster.from_profile("h100-sxm", gpus, 8)
        t = step_time(shape, lay, cluster, calib)
        assert t.dp_comm < t.compute - t.terms.optimizer  # all of it overlaps
        link = group_link(cluster, lay.dp, lay.tp, multi_rail=True)
        cost = (1 - calib.dp_overlap.value) + 3 * link.beta_Bps / (cluster.gpu.hbm_tbps * 1e12)
        assert t.dp_contention == pytest.approx(cost * t.dp_comm, rel=1e-12)
        assert 0 <= t.dp_comm_exposed - t.dp_contention < 1e-3  # + the loss all-reduce's latency
    assert 3 * 450e9 / 3.35e12 == pytest.approx(
        0.403, abs=1e-3
    )  # NVLink ring: 0.40 of its time from HBM
    assert 3 * 50e9 / 3.35e12 == pytest.approx(0.045, abs=1e-3)  # one 400 Gbit/s NIC's: 0.045


def test_megatron_tp_overlap_is_priced_per_gemm_by_hand():
    """Megatron's --tp-comm-overlap (Stack.tp_overlap): the step's TP term is TE's per-GEMM
    overlap (costmodel/tp_overlap.py) over the step's layers and micro-batches: one layer's
    all-gather and reduce-scatter (α–β over NVLink) under its linears' GEMM times, the 16-SM
    margin, the copy engines' HBM (2 x β(NVLink) / HBM of the hidden time). (Issue 39 replaced
    "everything hidden but the copies' HBM".)"""
    from dtrain.costmodel import step_time
    from dtrain.costmodel.collectives import all_gather_time, group_link, reduce_scatter_time
    from dtrain.costmodel.hardware import Cluster
    from dtrain.costmodel.stack import Stack
    from dtrain.costmodel.tp_overlap import layer_overlap, linear_shares

    shape = ModelShape.from_params(70e9)
    cluster = Cluster.from_profile("h100-sxm", 8, 8)
    lay = Layout(tp=8, recompute="none", micro_batch=4, sequence_parallel=True)
    plain = step_time(shape, lay, cluster)
    over = step_time(shape, lay, cluster, stack=Stack(tp_overlap=True))
    link = group_link(cluster, 8, 1, multi_rail=False)
    act = 4 * shape.seq_len * shape.d_model * 2
    gather, scatter = all_gather_time(act, 8, link), reduce_scatter_time(act, 8, link)
    per_fwd = over.terms.gemm / (3 * shape.n_layer * lay.grad_accum)
    gemms = {k: per_fwd * v for k, v in linear_shares(shape).items()}
    one = layer_overlap(gemms, gather, scatter, 8, 132, 2 * 450e9 / 3.35e12)
    assert over.tp_comm == pytest.approx(one.total * shape.n_layer * lay.grad_accum, rel=1e-9)
    # the layer's traffic is the plain model's: 4 gather + reduce-scatter pairs
    assert one.exposed + one.hidden == pytest.approx(plain.tp_comm / shape.n_layer, rel=1e-9)
    assert 0 < over.tp_comm < plain.tp_comm
    # Megatron asserts sequence parallelism for --tp-comm-overlap: without it nothing is hidden
    no_sp = replace(lay, sequence_parallel=False)
    assert step_time(shape, no_sp, cluster, stack=Stack(tp_overlap=True)).tp_comm == (
        pytest.approx(step_time(shape, no_sp, cluster).tp_comm, rel=1e-12)
    )


def test_dp_sync_at_the_flush_hides_nothing(capsys):
    """DeepSpeed's pipeline engine (Stack.dp_sync "flush") reduces the gradients after the
    pipeline's last step and all-gathers ZeRO-1's weights in the optimizer step: the whole
    once-per-step DP traffic is exposed; the default ("overlap", Megatron's) hides part of it.
    The flag reaches `dtrain plan`; an unknown value is refused."""
    import json

    from dtrain.cli.main import main
    from dtrain.costmodel import LinkModel, step_time
    from dtrain.costmodel.stack import Stack
    from dtrain.guide.local_host import host_cluster

    shape = ModelShape(6, 512, 8, 8, 1000, 128)
    cluster = host_cluster(1e11, 8, LinkModel(1e-5, 1e8))
    lay = Layout(dp_shard=2, pp=4, zero_stage=1, grad_accum=2)
    over = step_time(shape, lay, cluster, stack=Stack())
    flush = step_time(shape, lay, cluster, stack=Stack(dp_sync="flush"))
    assert flush.dp_comm == pytest.approx(over.dp_comm)
    loss = flush.dp_comm_exposed - flush.dp_comm
    assert 0 <= loss < 1e-3 and over.dp_comm_exposed < flush.dp_comm_exposed
    assert flush.total - over.total == pytest.approx(flush.dp_comm_exposed - over.dp_comm_exposed)
    with pytest.raises(ValueError, match=r"dp_sync='never' must be one of overlap, flush"):
        Stack(dp_sync="never")
    base = [
        "plan",
        "--params",
        "20e9",
        "--gpus",
        "64",
        "--global-batch",
        "256",
        "--json",
        "--top",
        "0",
        "--layout",
        "dp=8 tp=2 pp=4 zero=1 mb=1",
    ]
    steps = {}
    for sync in ("overlap", "flush"):
        assert main([*base, "--dp-sync", sync]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["dp_sync"] == sync
        steps[sync] = res["layout"]["step_time_s"]
    assert steps["flush"]["dp_comm_exposed"] > steps["overlap"]["dp_comm_exposed"]
    assert main([*base, "--dp-sync", "never"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: dtrain plan: argument --dp-sync: invalid choice: 'never'")
        and err.count("\n") == 1
    )


def test_neox_tflops_read_with_the_count_gpt_neox_logged_in_2022():
    """GPT-NeoX-20B's 117 TFLOP/s becomes tokens/s with megatron/logging.py get_flops as of 2022
    (a42805b4):
    6 x every parameter + 60·s·h·L per token, by hand for the 20B shape (44 x 6144, s 2048, V
    50432)."""
    from dtrain.costmodel.published_runs import load_rows, reported_tps, row_setup

    row = next(r for r in load_rows() if r["name"].startswith("GPT-NeoX-20B"))
    shape = row_setup(row).shape
    assert row["reported"]["flops"] == "neox_2022"
    n = shape.num_params()
    assert n == pytest.approx(20.55e9, rel=1e-3)
    assert reported_tps(row, shape) == pytest.approx(117e12 / (6 * n + 60 * 2048 * 6144 * 44))


def test_probe_gemm_time_is_the_model_flops_on_a_flat_curve():
    # the probe's overhead = measured step - this GEMM time; on a curve with f(W) = 1 every GEMM
    # runs at the peak, so the time is exactly model FLOPs / peak (6·N_matmul + 12·L·h·s per token)
    from dtrain.costmodel.gemm_targets import gemm_step_s

    cfg = GPTConfig.from_preset("tiny")
    t = {"kind": "gpt", "config": vars(cfg), "micro_batch": 8, "tp": 1}
    tokens = 8 * cfg.seq_len
    assert gemm_step_s(t, GemmCurve(1.0, 0.0), 1e11, 4) == pytest.approx(
        tokens * flops_per_token(cfg) / 1e11
    )


def test_fitted_defaults_are_the_fit_to_every_development_row():
    """GPU_DP_OVERLAP, LINK_EFFICIENCY and ASYNC_TP_HIDDEN are not hand-picked: they are the
    backtest's fit to all its rows and AsyncTP pairs (re-fit them when a row or a term changes)."""
    from dtrain.costmodel.backtest_fit import fit
    from dtrain.costmodel.published_runs import load_rows
    from dtrain.costmodel.calibration import ASYNC_TP_HIDDEN, GPU_DP_OVERLAP
    from dtrain.costmodel.hardware import LINK_EFFICIENCY

    assert fit(list(load_rows())) == {
        "dp_overlap": GPU_DP_OVERLAP,
        "link_efficiency": LINK_EFFICIENCY,
        "async_tp_hidden": ASYNC_TP_HIDDEN,
    }


def test_fit_margin_is_the_mean_squared_log_error_at_the_fit_and_the_grids_runner_up(capsys):
    """`dtrain backtest` says how firmly the rows choose the defaults: the mean squared log error at
    the all-rows fit, recomputed here row by row through predict(), and at the grid's second-best
    point, another grid point no better than the fit; the text names both and the folds' fits."""
    import math
    import statistics

    from dtrain.cli.main import main
    from dtrain.costmodel.backtest_fit import FIT_GRID, fit, fit_margin, predict
    from dtrain.costmodel.published_runs import load_rows, reported_tps, row_setup

    rows = [r for r in load_rows() if not r.get("expect_oom")]
    best, margin = fit(list(load_rows())), fit_margin(list(load_rows()))

    def mse(point):
        errs = []
        for r in rows:
            s = row_setup(r)
            tps = predict(s, point)[0].tokens_per_s / s.layout.gpus
            errs.append(math.log(tps / reported_tps(r, s.shape)) ** 2)
        return statistics.fmean(errs)

    assert margin["mse"] == pytest.approx(mse(best), abs=1e-8)
    other = {**margin["runner_up"], "async_tp_hidden": None}
    assert (other["dp_overlap"], other["link_efficiency"]) != (
        best["dp_overlap"],
        best["link_efficiency"],
    )
    assert margin["mse"] <= margin["runner_up_mse"]
    assert other["dp_overlap"] in FIT_GRID["dp_overlap"]
    assert other["link_efficiency"] in FIT_GRID["link_efficiency"]
    assert main(["backtest", "--no-rank"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        f"the fit to every row (the defaults): dp_overlap {best['dp_overlap']:g}, "
        f"link_efficiency {best['link_efficiency']:g}, mean squared log error "
        f"{margin['mse']:.5f}; the grid's next, {other['dp_overlap']:g} / "
        f"{other['link_efficiency']:g}: {margin['runner_up_mse']:.5f}" in text
    )
    assert "the leave-one-source-out folds: " in text


def test_async_tp_share_is_the_time_its_pairs_saved_and_left_out_per_source():
    """A pair (the row with AsyncTP, its `without` twin) measures the share of TP traffic AsyncTP
    hides: the reported step time it saved over the TP traffic the model prices, by hand; a
    source's rows are predicted with the other sources' pairs only."""
    from dtrain.costmodel.backtest_fit import async_tp_shares, loso_fits, predict
    from dtrain.costmodel.published_runs import load_rows, row_setup

    rows = load_rows()
    by_name = {r["name"]: r for r in rows}
    shares = async_tp_shares(rows, {})
    assert len(shares) == 2
    name = "torchtitan Llama 3.1 70B, FSDP32 x TP8, 256 H100, Float8 + AsyncTP"
    base = row_setup(by_name[by_name[name]["without"]])
    step = (
        512 * 8192 / 256 / 829
    )  # global batch x seq / GPUs / reported tokens/s per GPU, without AsyncTP
    assert shares[name] == pytest.approx(step * (1 - 829 / 876) / predict(base, {})[0].tp_comm)
    other = "torchtitan Llama 3.1 405B, FSDP16 x TP8, 128 H100, Float8 + AsyncTP"
    fits = loso_fits(rows)
    eff = fits["torchtitan-2024-12"]["link_efficiency"]
    assert fits["torchtitan-2024-12"]["async_tp_hidden"] == round(
        async_tp_shares(rows, {"link_efficiency": eff})[other], 2
    )  # 2024-12 rows: the 2024-08 pair alone
    # the stack runs it: AsyncTP hides that share of the TP traffic (no more than the GEMMs it
    # overlaps)
    with_it = row_setup(by_name[name])
    t0, t1 = (
        predict(base, {"async_tp_hidden": 0.2})[0],
        predict(with_it, {"async_tp_hidden": 0.2})[0],
    )
    assert t1.tp_comm == pytest.approx(0.8 * t0.tp_comm)
