"""The eager FSDP stack (costmodel/eager.py): launch counts against the measured step profiles,
the foreach chunking, the dispatch floor, FSDP's block-by-block overlap and the eager peak memory,
each against a hand count."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.costmodel import eager
from dtrain.costmodel.calibration import Calibration
from dtrain.costmodel.hardware import Cluster, get_profile
from dtrain.costmodel.measured_cases import eager_stack, gpt_case_shape
from dtrain.costmodel.memory import memory_per_gpu
from dtrain.costmodel.model_states import embedding_params_per_gpu, params_per_gpu
from dtrain.costmodel.stack_memory import memory_for
from dtrain.costmodel.search import search
from dtrain.costmodel.shapes import Layout, ModelShape
from dtrain.costmodel.software import software, unsupported
from dtrain.costmodel.stack import Stack
from dtrain.costmodel.timemodel import step_time
from dtrain.model.args import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "measured/h200/probe-20261126-0510/step_profile.json"


def _cases():
    return json.loads(PROBE.read_text())["cases"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c['preset']}-mb{c['micro_batch']}")
def test_launch_counts_match_the_measured_profile(case):
    """gemm, attention, loss and the optimizer's foreach launches exactly; elementwise (with
    memcpy/memset) within 1%: the count formula against the committed H200 profile."""
    cfg = GPTConfig.from_preset(case["preset"], **case["overrides"])
    shape, structure = gpt_case_shape(cfg)
    counts = eager.kernel_counts(shape, Layout(micro_batch=case["micro_batch"]), structure)
    got = case["kernels_by_category"]
    for cat in ("gemm", "attention", "loss", "optimizer"):
        assert counts[cat] == got[cat], cat
    measured = got["elementwise"] + got["memcpy"]
    assert abs(counts["elementwise"] - measured) <= 0.01 * measured
    assert abs(sum(counts.values()) - case["kernels"]) <= 0.01 * case["kernels"]


def test_fp8_launches_are_the_measured_profiles():
    """torchao's eager casts: FP8_LAUNCHES_PER_LINEAR per block linear and micro-batch, the
    difference of the committed 7B/4-layer profiles in FP8 and bf16 over their 24 linears; the
    FP8 count is the FP8 profile's within 0.1%; a full recompute runs a third of them again."""
    report = ROOT / "measured/h100-sxm/gpu-check-20261127-164510/report.json"
    steps = {s["name"]: s["data"].get("cases") for s in json.loads(report.read_text())}
    fp8 = next(c for c in steps["eager_sweep"] if c.get("precision") == "fp8")
    bf16 = next(
        c
        for c in steps["step_profile"]
        if c["preset"] == "7b" and c["micro_batch"] == fp8["micro_batch"]
    )
    assert (fp8["kernels"] - bf16["kernels"]) / 24 == eager.FP8_LAUNCHES_PER_LINEAR == 80
    shape, structure = gpt_case_shape(GPTConfig.from_preset("7b", n_layer=4))
    lay = Layout(micro_batch=2)
    counts = eager.kernel_counts(shape, lay, structure, fp8=True)
    assert abs(sum(counts.values()) - fp8["kernels"]) <= 0.001 * fp8["kernels"]
    plain = eager.kernel_counts(shape, lay, structure)
    assert counts["elementwise"] - plain["elementwise"] == 4 * 6 * 80
    full = replace(lay, recompute="full")
    extra = eager.kernel_counts(shape, full, structure, fp8=True)["elementwise"]
    assert extra - eager.kernel_counts(shape, full, structure)["elementwise"] == 4 * (480 + 160)


def test_foreach_launches_by_hand():
    full = eager.CHUNK * eager.MAX_BLOCKS  # one launch's worth of chunks
    assert eager.foreach_launches([full], 1, False) == 1
    assert eager.foreach_launches([full + 1], 1, False) == 2
    assert eager.foreach_launches([1] * 110, 1, False) == 1  # 110 tensor slots at depth 1
    assert eager.foreach_launches([1] * 111, 1, False) == 2
    assert eager.foreach_launches([1] * 97, 1, True) == 2  # a scalar list leaves 96
    assert eager.foreach_launches([1] * 49, 3, False) == 2  # depth 3: 48 slots
    assert eager.foreach_launches([0, 0], 1, False) == 0  # empty tensors launch nothing
    # AdamW's 8 ops + clipping's 2 over one small tensor: one launch each, plus the extra one
    assert eager.optimizer_launches((10,), "foreach") == 8 + 2 + 1
    assert eager.optimizer_launches((10,), "fused") == 1 + 2 + 1


def test_dispatch_floor_by_hand():
    """A small model at a small batch is launch-bound: the step is launches x the host's cost."""
    shape = ModelShape(4, 256, 4, 4, 1000, 128, rotary=False)
    lay = Layout(micro_batch=1)
    stack = eager_stack("flash2")
    host, source = eager.host_op_s("h100-sxm")
    assert host == pytest.approx(38.1e-6) and "cpu_dispatch_s" in source
    counts = eager.kernel_counts(shape, lay)
    # per micro-batch: 4 layers x (18 GEMMs + 4 attention + 40 elementwise) + 3 head GEMMs + 4
    # loss kernels; per step 155 elementwise and the optimizer's foreach launches
    tensors = 1 + 4 * 8 + 1 + 1  # embedding, 8 per block, final norm, untied head
    assert counts["gemm"] == 4 * 18 + 3 and counts["attention"] == 16 and counts["loss"] == 4
    assert counts["elementwise"] == 4 * 40 + 155
    assert counts["optimizer"] == 10 + 1 and tensors < 96  # every op one launch
    kernels = sum(counts.values())
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 1, 8)
    t = step_time(shape, lay, cluster, Calibration(), stack=stack)
    assert t.kernels == kernels
    assert t.dispatch_floor == pytest.approx(kernels * host)
    assert t.launch_bound and t.total == pytest.approx(t.dispatch_floor)
    # the same step on the fused default stack has no floor
    fused = step_time(shape, lay, cluster, Calibration())
    assert fused.kernels == 0 and not fused.launch_bound


def test_fsdp_hooks_host_work_by_hand():
    """FSDP2 (ZeRO-2/3, one rank too) adds its hooks' host work per unit (blocks + root) and
    micro-batch; a plain step has none."""
    shape = ModelShape(4, 256, 4, 4, 1000, 128, rotary=False)
    per_unit, source = eager.fsdp_unit_launches()
    assert per_unit == 94 and "fsdp_host" in source
    plain = Layout(micro_batch=1)
    counts = eager.kernel_counts(shape, plain)
    assert eager.host_launches(shape, plain, counts) == sum(counts.values())
    z3 = Layout(micro_batch=1, grad_accum=2, zero_stage=3)
    counts = eager.kernel_counts(shape, z3)
    assert eager.host_launches(shape, z3, counts) == sum(counts.values()) + (4 + 1) * 2 * 94


def test_host_cost_is_the_measured_issue_time_per_launch():
    """eager.yaml's H100 host cost is what its source says: the median over the eager_sweep
    cases of the report of cpu_dispatch_s / kernel_counts' launches."""
    import statistics

    from dtrain.costmodel.measured_cases import report_cases

    report = Path(__file__).parents[1] / "measured/h100-sxm/gpu-check-20261127-085952/report.json"
    cases = [c for c in report_cases(report) if c.name.startswith("eager_sweep")]
    assert len(cases) == 13 and all(c.cpu_dispatch_s for c in cases)
    per = [
        c.cpu_dispatch_s / eager.kernels_per_step(c.shape, c.layout, c.stack.optimizer, c.structure)
        for c in cases
    ]
    assert eager.host_op_s("h100-sxm")[0] == pytest.approx(statistics.median(per), rel=2e-3)


def test_fsdp_hidden_by_hand():
    # 2 units, 1 micro-batch: gathers 4 s (1 per pass per unit), reduce-scatters 2 s (1 per unit)
    # forward: 1 unit's gather behind the other's forward (work/2/3 = 1): 1
    # backward: the first unit's gather + RS behind 2/3 of 3 = 2: 2; the last unit's gather only: 1
    assert eager.fsdp_hidden(4.0, 2.0, 6.0, 2, 1) == pytest.approx(1 + 2 + 1)
    # compute much longer than the traffic: all but the first gather and the last RS hide
    assert eager.fsdp_hidden(4.0, 2.0, 600.0, 2, 1) == pytest.approx(6.0 - 1 - 1)
    assert eager.fsdp_hidden(0.0, 0.0, 1.0, 2, 1) == 0.0


def test_peak_memory_by_hand():
    """One GPU, foreach AdamW: the larger of the end of forward (fp32 params 4 + m, v 8 + the bf16
    casts of the linears 2 + activations) and the optimizer step (4 + 4 + 8 + its 4 B temporary)."""
    shape = ModelShape(2, 512, 8, 8, 1000, 256, rotary=False)
    lay = Layout(micro_batch=1)
    base = memory_per_gpu(shape, lay, 1.0, True, False)
    psi = params_per_gpu(shape, 1, 1)  # the states' count (model_states.py's)
    linear = 2 * shape.param_count.matmul_per_layer + shape.param_count.lm_head
    forward = 12 * psi + 2 * linear + base.activations
    step = 20 * psi
    got = memory_for(shape, lay, eager_stack()).total
    assert got == pytest.approx(max(forward, step))
    fused = memory_for(shape, lay, eager_stack(optimizer="fused")).total
    assert fused == pytest.approx(max(forward, 16 * psi))


def test_peak_memory_logits_and_autocast_norms_by_hand():
    """At the end of forward the eager model holds 12 B per logit, not the unfused 14 (its bf16
    logits die with the forward); without FSDP autocast keeps the residual stream fp32 and casts
    the norm's output once per linear that reads it (``autocast_layer_bytes``), and the final
    norm's input is fp32; FSDP2's MixedPrecisionPolicy runs all in bf16 (no such term)."""
    shape = ModelShape(2, 512, 8, 8, 32000, 4096, rotary=False)
    s, h, v = 4096, 512, 32000
    lay = Layout(micro_batch=1)
    base = memory_per_gpu(shape, lay, 1.0, True, False)
    psi = params_per_gpu(shape, 1, 1)
    linear = 2 * shape.param_count.matmul_per_layer + shape.param_count.lm_head
    # autocast's block (stack_memory.autocast_layer_bytes) counts 40h a token where Korthikanti's
    # counts 32h, the final norm's fp32 input 2h more; a count of tensors, without the 5%
    acts = base.activations / 1.05 - 2 * s * v + 2 * (40 - 32) * s * h + 2 * s * h
    forward = 12 * psi + 2 * linear + acts
    assert forward > 20 * psi  # the end of forward is the peak here
    assert memory_for(shape, lay, eager_stack()).total == pytest.approx(forward)
    z3 = Layout(micro_batch=1, zero_stage=3)
    base3 = memory_per_gpu(shape, z3, 1.0, True, False)
    got = memory_for(shape, z3, eager_stack())
    # a count of tensors (stack_memory.counted_block): without activations.py's 5%
    assert got.activations == pytest.approx((base3.activations - 1.05 * 2 * s * v) / 1.05)


def test_fsdp_eager_runs_fsdp_only():
    sw = software("fsdp-eager")
    assert unsupported(sw, {"tp": 2}) and unsupported(sw, {"pp": 2})
    assert unsupported(sw, {"zero_stage": 1, "dp": 8})
    assert unsupported(sw, {"zero_stage": 3, "dp": 8}) is None
    shape = replace(ModelShape.from_params(1e9, seq_len=2048), name="1b")
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 8, 8)
    stack = Stack("flash2", "eager", "eager", software="fsdp-eager", optimizer="foreach")
    res = search(shape, cluster, 64, Calibration(), stack=stack)
    assert res.ranked and all(p.tp == 1 and p.pp == 1 for p in res.ranked)
    assert {p.zero_stage for p in res.ranked} <= {2, 3}
    assert all(p.time.kernels > 0 for p in res.ranked)


def test_full_recompute_adds_the_forward_launches():
    shape = ModelShape(4, 256, 4, 4, 1000, 128, rotary=False)
    base = eager.kernel_counts(shape, Layout(micro_batch=1))
    full = eager.kernel_counts(shape, Layout(micro_batch=1, recompute="full"))
    assert full["gemm"] - base["gemm"] == 4 * 6  # one forward GEMM per linear and block
    assert full["attention"] - base["attention"] == 4
    assert full["elementwise"] - base["elementwise"] == 4 * 16


def test_fsdp_unit_overlap_never_hides_more_than_the_window():
    """Unit by unit FSDP hides at most what the whole-step window would (min(traffic, work)), and
    strictly less when a unit's traffic outlasts its compute (a small per-rank batch)."""
    import random

    seed = 39
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(200):
        gather, reduce, work = (rng.uniform(0.001, 1.0) for _ in range(3))
        units, m = rng.randint(1, 40), rng.randint(1, 8)
        hidden = eager.fsdp_hidden(gather, reduce, work, units, m)
        assert 0.0 <= hidden <= min(gather + reduce, work) + 1e-12
    # 17 units, traffic twice the compute: the window would hide all the work, units cannot
    assert eager.fsdp_hidden(2.0, 1.0, 1.5, 17, 1) < 1.5
    shape = replace(ModelShape.from_params(1e9, seq_len=1024), name="1b")
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 64, 8)
    lay = Layout(dp_shard=64, zero_stage=3, micro_batch=1, grad_accum=1)
    t = step_time(shape, lay, cluster, Calibration(), stack=eager_stack())
    assert t.dp_comm_exposed > t.dp_comm - (t.compute - t.terms.optimizer)  # more than the window


def test_grad_accumulation_adds_by_hand():
    """dtrain's trainer and the eager stack add each micro-batch's weight gradients after the
    first into the fp32 .grad: 12 B per local parameter at the add rate; a stack that does not
    (here "any") has no such term."""
    from dtrain.costmodel.device_rates import device_of

    shape = ModelShape(4, 512, 8, 8, 1000, 256, rotary=False)
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 1, 8)
    lay = Layout(micro_batch=1, grad_accum=4)
    dtrain_stack = Stack("flash", "fused", "fused", software="dtrain")
    other = Stack("flash", "fused", "fused", software="any")
    dev = device_of(cluster, Calibration(), dtrain_stack)
    psi = params_per_gpu(shape, 1, 1)
    expected = 3 * dev.mem_s(12 * psi, "add")
    assert eager.grad_accum_s(psi, 4, dev) == pytest.approx(expected)
    assert eager.grad_accum_s(psi, 1, dev) == 0.0
    assert eager.grad_accum_s(psi, 4, dev, grad_bytes=2) == pytest.approx(expected / 2)
    with_adds = step_time(shape, lay, cluster, Calibration(), stack=dtrain_stack)
    without = step_time(shape, lay, cluster, Calibration(), stack=other)
    assert with_adds.terms.memory - without.terms.memory == pytest.approx(expected)
    assert with_adds.grad_accum == pytest.approx(expected) and without.grad_accum == 0.0


@pytest.mark.parametrize("software", ["torchtitan", "dtrain"])
def test_fsdp_under_pp_accumulates_the_stages_unsharded_gradients_by_hand(software):
    """torch.distributed.pipelining syncs FSDP2 on the last micro-batch only: the stage's whole
    (unsharded) gradient accumulates in the fp32 reduce dtype, 6 B for the first micro-batch's
    upcast and 10 B for each later add per stage parameter, not divided over the shard group (as
    memory_per_gpu holds it); a bf16 reduce dtype adds in bf16, 6 B; one micro-batch adds nothing.
    Without PP the reduced shard accumulates, 12 B per local parameter."""
    from dtrain.costmodel.device_rates import device_of

    shape = ModelShape(4, 512, 8, 8, 1000, 256, rotary=False)
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 8, 8)
    stack = Stack("flash", "fused", "fused", software=software)
    dev = device_of(cluster, Calibration(), stack)
    lay = Layout(dp_shard=4, pp=2, zero_stage=3, micro_batch=1, grad_accum=4)
    psi = params_per_gpu(shape, 1, 2)
    by_hand = dev.mem_s(6 * psi, "add") + 3 * dev.mem_s(10 * psi, "add")
    t = step_time(shape, lay, cluster, Calibration(), stack=stack)
    assert t.grad_accum == pytest.approx(by_hand)
    bf16 = step_time(shape, lay, cluster, Calibration(), stack=replace(stack, grad_reduce="bf16"))
    assert bf16.grad_accum == pytest.approx(3 * dev.mem_s(6 * psi, "add"))
    one = step_time(shape, replace(lay, grad_accum=1), cluster, Calibration(), stack=stack)
    assert one.grad_accum == 0.0
    flat = Layout(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=4)
    sharded = step_time(shape, flat, cluster, Calibration(), stack=stack)
    local = params_per_gpu(shape, 1, 1) / 8
    assert sharded.grad_accum == pytest.approx(3 * dev.mem_s(12 * local, "add"))


def test_fsdp2_copies_each_gather_out_on_the_compute_stream_by_hand(capsys):
    """FSDP2 copies every weight all-gather out into the parameters (read and write each gathered
    bf16 value: 4 B per stage parameter) as often as it gathers: ZeRO-3 twice a micro-batch (the
    root unit once),
    FSDP2's ZeRO-2 once, ZeRO-3 under PP once a step; nothing on one rank, nothing on Megatron
    (its buffers are the parameters). The plan names it, text and JSON."""
    import json

    from dtrain.cli.main import main
    from dtrain.costmodel.device_rates import device_of

    shape = ModelShape(4, 512, 8, 8, 1000, 256, rotary=False)
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 8, 8)
    stack = Stack("flash", "fused", "fused", software="torchtitan")
    dev = device_of(cluster, Calibration(), stack)
    psi = params_per_gpu(shape, 1, 1)

    def copy_out(lay, st=stack):
        return step_time(shape, lay, cluster, Calibration(), stack=st).fsdp_copy_out

    zero3 = Layout(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=3)
    root = embedding_params_per_gpu(shape, 1, 1)  # the root unit: gathered once a micro-batch
    assert copy_out(zero3) == pytest.approx(
        6 * dev.mem_s(4 * psi, "add") - 3 * dev.mem_s(4 * root, "add")
    )
    assert copy_out(replace(zero3, zero_stage=2)) == pytest.approx(3 * dev.mem_s(4 * psi, "add"))
    piped = Layout(dp_shard=4, pp=2, zero_stage=3, micro_batch=1, grad_accum=3)
    stage = params_per_gpu(shape, 1, 2)
    assert copy_out(piped) == pytest.approx(dev.mem_s(4 * stage, "add"))
    one = Cluster.from_profile(get_profile("h100-sxm"), 1, 8)
    alone = step_time(shape, Layout(zero_stage=3), one, Calibration(), stack=stack)
    assert alone.fsdp_copy_out == 0.0
    assert copy_out(zero3, Stack("flash", "fused", "fused", software="megatron-core")) == 0.0
    args = ["plan", "--software", "torchtitan", "--params", "8e9", "--gpus", "8"]
    lay = ["--layout", "dp=8 tp=1 pp=1 zero=3 recompute=full mb=1"]
    assert main([*args, *lay]) == 0
    assert "FSDP2 copy-out" in capsys.readouterr().out
    assert main([*args, *lay, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["layout"]["step_time_s"]
    assert 0 < st["fsdp_copy_out"] < st["compute_terms"]["memory"]


@pytest.mark.slow  # two gloo ranks
def test_fsdp2_copy_out_bytes_counted_on_two_cpu_ranks():
    """What eager.fsdp2_copy_out_s prices, counted from the ops FSDP2 dispatches on two gloo
    ranks: each block's bf16 weights copied out of both gathers of a forward and backward, 2 B
    written per parameter (as many read: FSDP2_COPY_OUT_PASSES x 2 B); the root's once (FSDP2
    keeps the root gathered after forward: the cost model, like the DP traffic, counts two)."""
    from dtrain.gpucheck.fsdp_copy_out import count

    got = count(layers=2)
    assert got["block"] == {"copy_outs": 2.0, "bytes_per_param": 2.0}
    assert got["root"] == {"copy_outs": 1.0, "bytes_per_param": 2.0}
    assert eager.FSDP2_COPY_OUT_PASSES * 2 == 2 * got["block"]["bytes_per_param"]
