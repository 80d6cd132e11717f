"""`dtrain backtest --measured`: a fabricated results folder (a gpu-check report with an old and a
new step-profile case, a CUDA trainer run, a CPU run) written, read back and scored; and `dtrain
plan --software fsdp-eager` printing its dispatch-floor and optimizer terms."""

import json

import pytest
import yaml

from dtrain.cli.main import main
from dtrain.costmodel.backtest_measured import backtest_measured, summary
from dtrain.costmodel.backtest_measured_text import text_lines
from dtrain.costmodel.calibration import Calibration
from dtrain.costmodel.hardware import Cluster, get_profile
from dtrain.costmodel.measured_cases import eager_stack, gpt_case_shape
from dtrain.costmodel.shapes import Layout
from dtrain.costmodel.timemodel import step_time
from dtrain.model.args import GPTConfig
from dtrain.results import contract_records
from dtrain.results.metrics import write_summary

H100 = "NVIDIA H100 80GB HBM3"
OLD = {  # the first profiles' fields
    "preset": "1b",
    "overrides": {"n_layer": 2},
    "micro_batch": 2,
    "seq_len": 2048,
    "step_s": 0.040,
    "gpu_s_by_category": {"gemm": 0.02, "elementwise": 0.01, "memcpy": 0.001},
    "gpu_busy_s": 0.031,
}
NEW = {  # the fields the new gpu-check adds
    **OLD,
    "overrides": {"n_layer": 2, "seq_len": 8192},
    "seq_len": 8192,
    "micro_batch": 1,
    "attention": "cudnn",  # SDPA's backend name: cuDNN's fused attention, the table's "flash"
    "optimizer": "fused",
    "step_s": 0.060,
    "peak_mem_bytes": 9 * 2**30,
    "gpu_kernel_sum_s": 0.05,
    "cpu_dispatch_s": 0.01,
    "kernels_by_category": {"gemm": 39, "attention": 8, "elementwise": 300, "memcpy": 20},
    "kernel_records": 2,  # every kernel (timeline.RECORDS_VERSION)
}


OOM = {  # a case that did not run (the new gpu-check's record of it)
    "preset": "7b",
    "overrides": {"seq_len": 32768},
    "micro_batch": 8,
    "error": "out of memory: CUDA out of memory. Tried to allocate 64.00 GiB",
}


def _fabricate(root):
    check = root / "gpu-check-1"
    check.mkdir(parents=True)
    steps = [
        {"name": "env", "status": "ok", "data": {}},
        {"name": "step_profile", "status": "ok", "data": {"device": H100, "cases": [OLD]}},
        {"name": "eager_sweep", "status": "ok", "data": {"device": H100, "cases": [NEW, OOM]}},
        {"name": "eager_sweep", "status": "failed", "data": {}},
    ]
    (check / "report.json").write_text(json.dumps(steps))
    cfg = GPTConfig.from_preset("1b", n_layer=2)
    _trainer_run(root, cfg)
    _trainer_run(root, cfg, "cpu")
    return cfg


def _trainer_run(root, cfg, device="cuda", layout=Layout(micro_batch=4), strategy="single"):
    """A complete fsdp-scaling run dir under ``root``/runs/gpu (or cpu) that measured 4 x 2048
    tokens in 0.1 s and 12 GiB."""
    folder = "gpu" if device == "cuda" else device
    run = root / "runs" / folder / "fsdp-scaling" / "20261127-000000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"subproject": "fsdp-scaling", "train": {"compile": False}})
    )
    gpu = H100 if device == "cuda" else None
    rec = contract_records.TrainingMeasurement(
        model={k: getattr(cfg, k) for k in contract_records.MODEL_SHAPE}
        | {"norm": cfg.norm, "bias": cfg.bias, "tie_embeddings": cfg.tie_embeddings},
        layout=layout,
        strategy=strategy,
        precision="bf16",
        step_time_s=0.1,
        tokens_per_s=4 * 2048 / 0.1,
        peak_mem_bytes=12 * 2**30,
        where=contract_records.where_of(device, "nccl" if gpu else "gloo", gpu),
    )
    write_summary(run, {"status": "complete", "guide_inputs": [rec]})


def test_measured_backtest_on_a_fabricated_folder(tmp_path):
    cfg = _fabricate(tmp_path)
    rows = backtest_measured(str(tmp_path))
    names = [r.case.name.split()[0] for r in rows]
    assert names == ["step_profile", "eager_sweep", "eager_sweep", "gpu"]
    old, new, oom, run = rows
    assert oom.predicted_s is None and oom.case.not_modelled.startswith("measured: out of memory")
    # each prediction is the cost model's step for that case, the error against the measured step
    shape, _ = gpt_case_shape(cfg)
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 1, 8)
    t = step_time(shape, Layout(micro_batch=4), cluster, Calibration(), stack=eager_stack())
    assert run.predicted_s == pytest.approx(max(t.total, run.dispatch_floor_s))
    assert run.error == pytest.approx(run.predicted_s / 0.1 - 1)
    assert run.memory_error == pytest.approx(run.predicted_mem_bytes / (12 * 2**30) - 1)
    # an old profile case: no memory, no launch counts; its memcpy folded into elementwise
    assert old.memory_error is None and not old.kernels
    assert old.by_category["elementwise"][0] == pytest.approx(0.011)
    # a new case: its fields read (8K tokens, cuDNN attention, fused AdamW) and scored
    assert new.case.shape.seq_len == 8192 and new.case.stack.optimizer == "fused"
    assert new.case.stack.attention == "flash" and new.case.cpu_dispatch_s == 0.01
    assert new.memory_error is not None
    assert new.kernels["elementwise"][0] == 320 and new.kernels["total"][0] == 367
    # the host's issue time per launch the model counts (as eager.yaml's host_op_s)
    assert new.host_per_launch_s == pytest.approx(0.01 / new.kernels["total"][1])
    assert old.host_per_launch_s is None
    # its session's host issue time floors the session's cases: the one timed case's floor is its
    # own cpu_dispatch_s; the trainer run outside any session takes eager.yaml's, another host's
    from dtrain.costmodel.backtest_measured import counted_launches
    from dtrain.costmodel.eager import host_op_s

    assert new.host_measured and old.host_measured and not run.host_measured
    assert new.dispatch_floor_s == pytest.approx(0.01)
    assert old.dispatch_floor_s == pytest.approx(
        0.01 / counted_launches(new.case) * counted_launches(old.case)
    )
    assert run.dispatch_floor_s == pytest.approx(
        counted_launches(run.case) * host_op_s("h100-sxm")[0]
    )
    lines = text_lines(rows)
    assert any(x.startswith("  GPU busy 31.0 ms of the step measured") for x in lines)
    assert any("does not fit (right)" in x for x in lines)  # 7B at 8 x 32K tokens on one H100
    assert max(len(x) for x in lines) <= 100
    assert any(x.startswith("summary: time within 10%:") for x in lines[-8:])
    # the GPU's idle time in a GPU-bound step (host issue 10 ms < GPU busy 31 ms): the step less
    # the kernels' union, reported per counted launch and beside the predicted GPU work
    assert new.gpu_idle_s == pytest.approx(0.060 - 0.031) and old.gpu_idle_s is None
    assert new.gpu_work_excess == pytest.approx(new.gpu_work_s / 0.031 - 1)
    s = summary(rows)
    assert s["gpu_bound_profiles"] == 1
    assert s["gpu_idle_per_launch_median_s"] == pytest.approx(0.029 / new.kernels["total"][1])
    assert any(x.startswith("GPU idle in the 1 GPU-bound profiles") for x in lines[-3:])


def test_records_without_lambda_kernels_measure_no_idle(tmp_path):
    """The records of 2026-11-27 (no ``kernel_records`` version) lack every kernel named after a
    lambda: their busy union is a lower bound, so the step less it is no idle time."""
    report = tmp_path / "gpu-check-1"
    report.mkdir()
    first = {k: v for k, v in NEW.items() if k != "kernel_records"}
    steps = [{"name": "eager_sweep", "status": "ok", "data": {"device": H100, "cases": [first]}}]
    (report / "report.json").write_text(json.dumps(steps))
    (row,) = backtest_measured(str(tmp_path))
    assert row.case.lambdas_dropped and row.gpu_idle_s is None and row.gpu_work_excess is None
    s = summary([row])
    assert s["gpu_bound_profiles"] == 0 and s["profiles_lacking_lambda_kernels"] == 1
    lines = text_lines([row])
    assert any(x.startswith("  GPU busy at least 31.0 ms") for x in lines)
    lacking = "1 profiles' kernel records lack every kernel named after a lambda"
    assert any(x.startswith(lacking) for x in lines[-4:])


def test_measured_backtest_cli_json_and_errors(tmp_path, capsys):
    _fabricate(tmp_path)
    assert main(["backtest", "--measured", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["runs"] == 4 and out["summary"]["time_scored"] == 3
    assert out["summary"]["memory_scored"] == 2
    assert {r["gpu"] for r in out["runs"]} == {"h100-sxm"}
    assert main(["backtest", "--measured", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --measured") and err.count("\n") == 1


def test_plan_fsdp_eager_prints_dispatch_floor_and_optimizer(capsys):
    argv = ["plan", "--software", "fsdp-eager", "--params", "1e9", "--seq", "8192", "--gpus", "8"]
    assert main([*argv, "--gpu", "h100-sxm"]) == 0
    text = capsys.readouterr().out
    assert "flash2 attention, eager kernels, foreach AdamW" in text
    assert (
        "  dispatch    floor " in text and "kernel launches (+ FSDP2's hooks) x the host's" in text
    )
    assert "GPU-bound" in text
    assert "  optimizer   foreach AdamW + gradient clipping" in text
    assert main([*argv, "--gpu", "h100-sxm", "--json", "--optimizer", "fused"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["optimizer"] == "fused" and plan["attention"] == "flash2"
    choice = plan["choice"]
    assert choice["kernels_per_step"] > 0 and choice["launch_bound"] is False
    assert choice["step_time_s"]["dispatch_floor"] > 0
    assert choice["tp"] == 1 and choice["pp"] == 1 and choice["zero_stage"] in (2, 3)


def test_measured_backtest_reads_an_fp8_profile_with_phases_and_gaps(tmp_path):
    """The eager sweep's torchao float8 case is priced as FP8 on the eager stack; its phases'
    host/GPU times and its longest GPU gaps are printed under it."""
    phases = {"forward": {"host_s": 0.001, "gpu_s": 0.002}, "clip": {"host_s": 0.0005}}
    case = {
        **NEW,
        "precision": "fp8",
        "phases": phases,
        "largest_gaps": [{"gap_s": 0.0012, "after": "amax_kernel", "before": "Memcpy DtoH"}],
        "top_kernels": [
            {"name": "abs_kernel", "category": "elementwise", "launches": 48, "s": 0.02}
        ],
    }
    check = tmp_path / "gpu-check-1"
    check.mkdir()
    steps = [{"name": "eager_sweep", "status": "ok", "data": {"device": H100, "cases": [case]}}]
    (check / "report.json").write_text(json.dumps(steps))
    (row,) = backtest_measured(str(tmp_path))
    assert row.case.precision == "fp8" and row.case.name.endswith(" fused fp8")
    assert row.case.note == ""  # its casts' launches are counted: 80 per block linear
    fp8_launches = row.kernels["total"][1]  # against the bf16 twin's below
    lines = text_lines([row])
    assert "  phases host/GPU ms: forward 1.0/2.0 clip 0.5/-" in lines
    assert "  longest GPU gaps: 1.20 ms after amax_kernel before Memcpy DtoH" in lines
    assert "  most GPU time: abs_kernel 20.0 ms in 48" in lines
    bf16 = backtest_measured_case_without_fp8(tmp_path, case)
    assert row.predicted_s > bf16.predicted_s  # FP8's casts cost more than its GEMMs save here
    linears = row.case.shape.n_layer * 6  # the GPT's q, k, v, o and its two MLP matrices
    assert fp8_launches - bf16.kernels["total"][1] == 80 * linears


def backtest_measured_case_without_fp8(tmp_path, case):
    other = tmp_path / "bf16" / "gpu-check-1"
    other.mkdir(parents=True)
    steps = [
        {
            "name": "eager_sweep",
            "status": "ok",
            "data": {"device": H100, "cases": [{**case, "precision": "bf16"}]},
        }
    ]
    (other / "report.json").write_text(json.dumps(steps))
    (row,) = backtest_measured(str(other.parent))
    assert row.case.precision == "bf16"
    return row


def test_each_session_is_floored_with_its_own_hosts_issue_time():
    """A session whose profiles timed the host (cpu_dispatch_s) floors every case of it, its
    trainer runs too, with that host's issue time: the 2026-11-27 H100's is eager.yaml's. The
    sessions that timed none (the 2026-11-25 H100's, the H200's) take eager.yaml's, another
    host's: the table says so where that floor sets the step."""
    from pathlib import Path

    from dtrain.costmodel.backtest_measured import session_host_s, session_of
    from dtrain.costmodel.eager import host_op_s
    from dtrain.costmodel.measured_cases import measured_cases

    folder = Path(__file__).parents[1] / "measured"
    hosts = session_host_s(measured_cases(folder))
    assert list(hosts) == ["gpu-check-20261127-085952", "gpu-check-20261127-164510"]
    assert hosts["gpu-check-20261127-085952"] == pytest.approx(host_op_s("h100-sxm")[0], rel=2e-3)
    # the afternoon's host: the median of its 13 bf16 eager_sweep cases (its FP8 case left out:
    # its host waits on the GPU), within 1% of the morning's
    assert hosts["gpu-check-20261127-164510"] == pytest.approx(37.7e-6, rel=3e-3)
    rows = backtest_measured(folder)
    own = {(r.case.gpu, session_of(r.case)) for r in rows if r.host_measured}
    other = {(r.case.gpu, session_of(r.case)) for r in rows if not r.host_measured}
    assert own == {
        ("h100-sxm", "gpu-check-20261127-085952"),
        ("h100-sxm", "gpu-check-20261127-164510"),
    }
    assert {("h100-sxm", "gpu-check-20261125-105450"), ("h200", "probe-20261126-0510")} <= other
    assert all(r.host_measured for r in rows if r.case.name.startswith("eager_125m"))  # trainer
    text = "\n".join(text_lines(rows))
    named = [r for r in rows if r.launch_bound and not r.host_measured]
    assert len(named) == text.count("floor: this host's issue time was not measured") == 3


def test_a_sessions_host_rate_is_its_short_sequence_issue_where_measured(tmp_path):
    """A GPU-bound step's cpu_dispatch_s includes the host's waits on the GPU; where the session
    timed each step's issue at a short sequence (host_issue_s), its host rate is the median of
    those over the model's launches, printed beside the long step's; FP8 cases do not count."""
    from dataclasses import replace

    from dtrain.costmodel.backtest_measured import counted_launches, session_host_s
    from dtrain.costmodel.measured_cases import measured_cases

    waits = {**NEW, "cpu_dispatch_s": 0.05, "host_issue_s": 0.012, "issue_tokens": 128}
    short = {**NEW, "seq_len": 2048, "cpu_dispatch_s": 0.02, "host_issue_s": 0.016}
    fp8 = {**NEW, "precision": "fp8", "host_issue_s": 0.5}
    check = tmp_path / "gpu-check-1"
    check.mkdir()
    data = {"device": H100, "cases": [waits, short, fp8]}
    report = [{"name": "eager_sweep", "status": "ok", "data": data}]
    (check / "report.json").write_text(json.dumps(report))
    cases = measured_cases(tmp_path)
    assert len(cases) == 3
    per = sorted(c.host_issue_s / counted_launches(c) for c in cases[:2])
    assert session_host_s(cases) == {"gpu-check-1": pytest.approx(sum(per) / 2)}
    # without host_issue_s the session takes cpu_dispatch_s, as before
    (old,) = [replace(c, host_issue_s=None) for c in cases[:1]]
    assert session_host_s([old]) == {"gpu-check-1": pytest.approx(0.05 / counted_launches(old))}
    # the text: the long step's issue time and the short one's, per launch
    first = backtest_measured(str(tmp_path))[0]
    n = first.kernels["total"][1]
    line = " ".join(text_lines([first]))
    assert f"at a short sequence 12.0 ms ({0.012 / n * 1e6:.1f} us per launch)" in line


def test_term_by_term_summary_compares_complete_profiles_only(tmp_path):
    """The summary's terms: predicted over measured GPU seconds per category group (elementwise
    and loss together), over the profiles whose records hold every kernel once."""
    from dtrain.costmodel.backtest_measured import term_ratios
    from dtrain.costmodel.backtest_measured_text import terms_line

    complete = {**NEW, "gpu_s_by_category": {"gemm": 0.02, "elementwise": 0.01, "loss": 0.002}}
    partial = {**complete, "kernel_records": 1}  # the 2026-11-27 records: lambdas missing
    check = tmp_path / "gpu-check-1"
    check.mkdir()
    data = {"device": H100, "cases": [complete, partial]}
    report = [{"name": "eager_sweep", "status": "ok", "data": data}]
    (check / "report.json").write_text(json.dumps(report))
    rows = backtest_measured(str(tmp_path))
    terms = term_ratios(rows)
    pred = rows[0].by_category
    want = (pred["elementwise"][1] + pred["loss"][1]) / 0.012 - 1
    assert terms["elementwise+loss"] == {
        "median": pytest.approx(want),
        "range": [pytest.approx(want), pytest.approx(want)],
        "profiles": 1,
    }
    assert terms["gemm"]["median"] == pytest.approx(pred["gemm"][1] / 0.02 - 1)
    assert "attention" not in terms  # measured 0 s: no ratio
    assert summary(rows)["terms"] == terms
    line = terms_line(terms)
    assert line.startswith("term by term, predicted over measured GPU seconds in the 1 profiles")
    assert f"gemm {terms['gemm']['median']:+.0%}" in line


def test_a_session_prices_fsdp2_hooks_with_its_hosts_own_probe(tmp_path):
    """A session whose GPU's host ran the FSDP2 probe (host/fsdp_host*.json, FSDP2 against the
    plain autocast step) prices its FSDP2 runs' hooks at that probe's launches per unit, the
    median over its probes; an FSDP1 or fp32-plain probe and an unreadable file price nothing,
    and a session without a probe keeps eager.yaml's."""
    from dtrain.costmodel.backtest_measured import counted_launches, session_unit_launches
    from dtrain.costmodel.eager import fsdp_unit_launches, host_op_s
    from dtrain.costmodel.measured_cases import measured_cases

    cfg = GPTConfig.from_preset("125m")  # launch-bound at 4 x 2K tokens in FSDP2
    check = tmp_path / "gpu-check-1"
    zero3 = Layout(micro_batch=4, zero_stage=3)
    _trainer_run(check, cfg, layout=zero3, strategy="zero3")
    host = check / "host"
    host.mkdir()
    probes = {
        "fsdp_host_a.json": {"fsdp": 2, "plain": "autocast", "launch_equivalents": 140.0},
        "fsdp_host_b.json": {"fsdp": 2, "plain": "autocast", "launch_equivalents": 160.0},
        "fsdp_host_fp32.json": {"fsdp": 2, "plain": "fp32", "launch_equivalents": 900.0},
        "fsdp_host_fsdp1.json": {"fsdp": 1, "plain": "autocast", "launch_equivalents": 900.0},
    }
    for name, probe in probes.items():
        (host / name).write_text(json.dumps(probe))
    (host / "fsdp_host_cut.json").write_text('{"fsdp": 2, "pla')  # cut off mid-write
    (host / "fsdp_host_list.json").write_text("[1, 2]")  # not a probe's object
    (host / "fsdp_host_bare.json").write_text('{"fsdp": 2, "plain": "autocast"}')  # no count
    (case,) = measured_cases(tmp_path)
    assert case.layout.zero_stage == 3
    assert session_unit_launches([case]) == {"gpu-check-1": 150.0}
    (row,) = backtest_measured(str(tmp_path))
    assert row.unit_launches == 150.0
    units = cfg.n_layer + 1  # each block and the root, one micro-batch
    assert counted_launches(case, 150.0) - counted_launches(case) == pytest.approx(
        units * (150.0 - fsdp_unit_launches()[0])
    )
    # no profile timed this host's issue: eager.yaml's time per launch, the probe's launches
    assert row.dispatch_floor_s == pytest.approx(
        counted_launches(case, 150.0) * host_op_s("h100-sxm")[0]
    )
    assert row.launch_bound and row.predicted_s == pytest.approx(row.dispatch_floor_s)
    assert any("this host's own probe, 150 launches per unit" in x for x in text_lines([row]))
    # the same run in a session without a probe: eager.yaml's fsdp2_unit
    bare = tmp_path / "bare"
    _trainer_run(bare / "gpu-check-2", cfg, layout=zero3, strategy="zero3")
    (plain,) = backtest_measured(str(bare))
    assert plain.unit_launches is None
    assert plain.dispatch_floor_s == pytest.approx(
        counted_launches(plain.case) * host_op_s("h100-sxm")[0]
    )


def test_the_measured_floor_replaces_the_plans_whatever_its_size():
    """``StepTime.gpu_work`` is the eager step without the dispatch floor, so a host measured
    faster than eager.yaml's lowers a launch-bound prediction (``score`` floors the GPU's work,
    not the plan's already-floored total)."""
    from dtrain.costmodel.backtest_measured import counted_launches, score
    from dtrain.costmodel.measured_cases import Case, gpt_case_shape

    cfg = GPTConfig.from_preset("125m")
    shape, structure = gpt_case_shape(cfg)
    lay = Layout(micro_batch=1)
    cluster = Cluster.from_profile(get_profile("h100-sxm"), 1, 8)
    t = step_time(shape, lay, cluster, Calibration(), stack=eager_stack())
    assert t.launch_bound and t.gpu_work < t.dispatch_floor == t.total
    case = Case("x", "", "h100-sxm", shape, structure, lay, eager_stack(), "bf16", 0.03)
    fast = 20e-6  # a host twice as fast as eager.yaml's
    row = score(case, fast)
    assert row.predicted_s == pytest.approx(max(t.gpu_work, counted_launches(case) * fast))
    assert row.predicted_s < t.total
