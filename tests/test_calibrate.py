"""dtrain.costmodel.calibrate: measured over datasheet, provenance, and the CPU/GPU rule."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import yaml

from dtrain.costmodel import Cluster, LinkModel
from dtrain.costmodel.calibrate import calibrate
from dtrain.costmodel.calibration_tp import tp_modelled_comm_s
from dtrain.guide.local_check import local_checks
from dtrain.results import contract, contract_records
from dtrain.results.derived import write_derived_run
from dtrain.results.metrics import write_summary

FIXTURES = Path(__file__).parent / "fixtures" / "results"
CPU, GPU = FIXTURES / "cpu", FIXTURES / "gpu"
NAMES = ("mfu", "dp_overlap", "tp_overhead", "fp8_speedup", "fp8_memory_factor")


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_cpu_runs_calibrate_local_but_not_the_gpu_matrix():
    rep = calibrate([CPU], base=FIXTURES, warn=False)
    for name in NAMES:
        assert getattr(rep.cluster, name).provenance.startswith("datasheet/published:"), name
        local = getattr(rep.local, name)
        assert local.measured and ", cpu (gloo, 2 ranks)" in local.provenance, name
    assert not rep.measured_on_gpu
    assert all(
        p.provenance.startswith("datasheet/published:") for p in vars(rep.cluster_links).values()
    )
    # the incomplete run is not read
    assert (
        not any("crashed" in str(r.path) for r in rep.runs) and len(rep.runs) == 7
    )  # tp-attention-cp included


def test_local_values_and_provenance_by_hand():
    rep = calibrate([CPU], base=FIXTURES, warn=False)
    zero3 = CPU / "fsdp-scaling/20250301-100100-000001"
    [g] = contract.read(_summary(zero3))
    # compute-only efficiency: the time model costs the exposed communication separately
    assert rep.local.mfu.value == pytest.approx(
        g.mfu * g.step_time_s / (g.step_time_s - g.exposed_comm_s)
    )
    assert rep.local.mfu.provenance.startswith(
        "measured here: cpu/fsdp-scaling/20250301-100100-000001, 2025-03-01T10:01:01+00:00, cpu"
    )
    assert (
        rep.local.dp_overlap.value == 0.46
    )  # only sharded strategies measure overlap (ddp's is null)
    # fp8: the fastest recipe within the loss noise band wins, not the fastest overall
    assert (
        rep.local.fp8_speedup.value == 0.71
        and "recipe emulated" in rep.local.fp8_speedup.provenance
    )
    assert rep.local.fp8_memory_factor.value == 1.06
    link = rep.local_links["intra"]
    # the fit's 62.5 µs is a whole 2-rank all_reduce: 2(n-1) = 2 ring hops, so 31.25 µs per hop
    assert (link.alpha_s, link.beta_Bps) == (pytest.approx(31.25e-6), pytest.approx(1.6e9))
    assert "inter" not in rep.local_links  # one host: no inter-node fit
    assert rep.keep_bf16_local[0] == ["blocks.0.attn.wq", "lm_head"]
    assert rep.keep_bf16[1].startswith(
        "datasheet/published:"
    )  # CPU numerics do not set the cluster's


def test_tp_overhead_is_measured_over_alpha_beta_comm_time():
    rep = calibrate([CPU], base=FIXTURES, warn=False)
    link = LinkModel(31.25e-6, 1.6e9)
    # block = 2 TP regions; 4 collectives per region fwd+bwd, 2(n-1) hops each at n = 2
    modelled = 4194304 / 1.6e9 + 4 * 2 * 1 * 31.25e-6
    assert tp_modelled_comm_s({"tp": 2, "comm_bytes_per_layer": 4194304}, link, 2) == pytest.approx(
        modelled
    )
    ratios = sorted([0.125 * 0.22 / modelled, 0.13 * 0.24 / modelled])
    assert rep.local.tp_overhead.value == pytest.approx(ratios[1])  # median of two = the upper one


def test_gpu_runs_win_for_the_matrix_and_cpu_values_stay_local():
    rep = calibrate([CPU, GPU], base=FIXTURES, warn=False)
    assert rep.measured_on_gpu
    # on a GPU a training run's MFU is what the term-by-term model predicts, not an input: the GEMM
    # curve stays published until a CUDA gemm-probe measures it
    assert rep.cluster.mfu.provenance.startswith("datasheet/published:")
    assert rep.cluster.dp_overlap.provenance.startswith("measured here: gpu/fsdp-scaling/")
    assert "NVIDIA H100 80GB HBM3 (nccl, 8 ranks)" in rep.cluster.dp_overlap.provenance
    assert rep.cluster.dp_overlap.value == 0.81
    assert rep.cluster.tp_overhead.provenance.startswith(
        "datasheet/published:"
    )  # no GPU tp-attention run
    links = rep.cluster_links
    assert links.intra_efficiency.value == pytest.approx(
        0.8
    ) and links.inter_efficiency.value == pytest.approx(0.82)
    assert links.intra_alpha_s.value == pytest.approx(14e-6 / 30)  # 16-rank fit: 2(n-1) = 30 hops
    # the local (any device) calibration takes the CPU runs' compute efficiency
    assert rep.local.mfu.provenance.startswith("measured here: cpu/")


def test_link_calibration_scales_the_nominal_rates():
    rep = calibrate([GPU], base=FIXTURES, warn=False)
    c = rep.cluster_links.apply(Cluster.from_profile("h100-sxm", 64, 8, ib_gbit_per_gpu=400))
    assert c.nvlink.beta_Bps == pytest.approx(0.8 * 450e9) and c.ib.beta_Bps == pytest.approx(
        0.82 * 50e9
    )
    assert (c.nvlink.alpha_s, c.ib.alpha_s) == (
        pytest.approx(14e-6 / 30),
        pytest.approx(22e-6 / 30),
    )


def _set(run: Path, **changes) -> None:
    """Rewrite a fixture run's one training record through the real writer."""
    summary = _summary(run)
    [m] = contract.read(summary)
    write_summary(run, {**summary, "guide_inputs": [dataclasses.replace(m, **changes)]})


def test_latest_run_wins_and_derived_runs_add_no_copies(tmp_path):
    shutil.copytree(CPU, tmp_path / "cpu")
    zero3 = tmp_path / "cpu/fsdp-scaling/20250301-100100-000001"
    newer = tmp_path / "cpu/fsdp-scaling/20250305-000000-000000"
    shutil.copytree(zero3, newer)
    env = json.loads((newer / "env.json").read_text())
    env["created"] = "2025-03-05T00:00:00+00:00"
    (newer / "env.json").write_text(json.dumps(env))
    _set(newer, overlap_fraction=0.7)
    # a study report over both zero3 runs: a derived run that names them and publishes nothing of
    # theirs
    report = write_derived_run(
        tmp_path / "cpu/fsdp-scaling/report",
        "fsdp-scaling",
        [newer, zero3],
        {"report": True},
        {"study": {"runs": 2}},
    )
    assert contract.derived_from(_summary(report), report) == [newer.resolve(), zero3.resolve()]
    assert yaml.safe_load((report / "config.yaml").read_text())["derived_from"] == [
        "../20250305-000000-000000",
        "../20250301-100100-000001",
    ]
    rep = calibrate([tmp_path / "cpu"], base=tmp_path, warn=False)
    assert rep.local.dp_overlap.value == 0.7 and "2025-03-05" in rep.local.dp_overlap.provenance
    overlaps = [c for c in rep.candidates if c.name == "dp_overlap"]
    assert len(overlaps) == 2  # one per zero3 run, none from the report


def test_an_unknown_experiment_with_a_typed_summary_is_calibrated(tmp_path):
    """Calibration reads records, not experiment names: a run of an experiment it has never heard of
    (its own subproject, config keys and files) counts like fsdp-scaling's."""
    run = tmp_path / "my-new-study" / "run1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("subproject: my-new-study\nanything: [1, 2]\n")
    (run / "env.json").write_text(
        json.dumps(
            {
                "created": "2026-01-01T00:00:00+00:00",
                "device": "cpu",
                "backend": "gloo",
                "world_size": 2,
            }
        )
    )
    [m] = contract.read(_summary(CPU / "fsdp-scaling/20250301-100100-000001"))
    write_summary(
        run,
        {
            "subproject": "my-new-study",
            "status": "complete",
            "guide_inputs": [dataclasses.replace(m, overlap_fraction=0.33)],
        },
    )
    shutil.copytree(
        CPU / "allreduce-bench", tmp_path / "allreduce-bench"
    )  # the link the local check needs
    rep = calibrate([tmp_path], base=tmp_path, warn=False)
    assert [r.path for r in rep.runs][-1] == run and len(rep.runs) == 2
    assert rep.local.dp_overlap.value == 0.33
    assert rep.local.dp_overlap.provenance.startswith(
        "measured here: my-new-study/run1, 2026-01-01T00:00:00+00:00, cpu"
    )
    assert rep.local.mfu.value == pytest.approx(
        m.mfu * m.step_time_s / (m.step_time_s - m.exposed_comm_s)
    )
    checks = local_checks(rep, tmp_path)
    assert [(c.experiment, c.run, c.what) for c in checks] == [
        ("my-new-study", "my-new-study/run1", "zero3 x2 step")
    ]


def test_a_run_breaking_the_contract_is_skipped_with_a_warning(tmp_path):
    shutil.copytree(CPU / "fsdp-scaling", tmp_path / "fsdp-scaling")
    bad = tmp_path / "fsdp-scaling/20250301-100100-000001"
    s = _summary(bad)
    s["guide_inputs"]["records"][0]["step_time_s"] = "fast"
    (bad / "summary.json").write_text(json.dumps(s))
    with pytest.warns(
        UserWarning,
        match=r"skipping run .*20250301-100100-000001: summary.json "
        r"guide_inputs.records\[0\] \(training\).step_time_s='fast' must be a finite number",
    ):
        rep = calibrate([tmp_path], warn=True)
    assert [r.path.name for r in rep.runs] == ["20250301-100100-000000"]


def test_a_summary_from_before_the_contract_is_named(tmp_path):
    run = tmp_path / "fsdp-scaling/old"
    shutil.copytree(CPU / "fsdp-scaling/20250301-100100-000000", run)
    s = _summary(run)
    del s["guide_inputs"]
    (run / "summary.json").write_text(json.dumps({**s, "guide": {"strategy": "ddp"}}))
    with pytest.warns(
        UserWarning, match=r"old has no guide_inputs \(an older summary.json format\): rerun it"
    ):
        rep = calibrate([tmp_path])
    assert not rep.candidates


def test_missing_results_path_raises():
    with pytest.raises(FileNotFoundError, match="no such results path"):
        calibrate(["/nonexistent/results"])


def test_gemm_probe_overheads_give_the_local_step_overhead(tmp_path):
    over = [
        contract_records.StepOverhead(
            "gpt", {"n_layer": n, "d_model": 64}, 1, 1, s, step_s=s + 0.001, gemm_s=0.001
        )
        for n, s in ((2, 0.004), (4, 0.010), (8, 0.030))
    ]
    record = contract_records.GemmProbe(
        dtype="float32",
        peak_flops=1e10,
        peak_flops_source="probe",
        points=[],
        overheads=over,
        e_max=0.9,
        w_half=1e5,
        where=contract_records.where_of("cpu", "none"),
    )
    write_derived_run(
        tmp_path / "gemm-probe",
        "gemm-probe",
        [],
        {"device": "cpu", "threads": 1},
        {},
        [record],
        env={
            "created": "2030-01-01T00:00:00+00:00",
            "device": "cpu",
            "backend": "none",
            "world_size": 1,
        },
    )
    rep = calibrate([tmp_path], base=tmp_path, warn=False)
    assert rep.local.step_overhead_s.value == pytest.approx(0.010)  # median of the three models
    assert "GPT 2x64 mb1 4.0 ms" in rep.local.step_overhead_s.provenance
    assert rep.cluster.step_overhead_s.value == 0.0  # a CPU probe does not set the GPU matrix's


def test_a_cuda_gemm_probe_measures_the_plateau_under_the_kernel_tables_w_half():
    """On a GPU with a kernel table, e_max = median over the single GEMMs of >= 100 us of f·(W +
    W_half)/W with W_half the table's (4.8 GFLOP on h100-sxm): the runs' GEMMs sit on the plateau
    and do not pin W_half. Shorter and batched GEMMs are left out; a GPU without a table keeps
    the two-parameter fit."""
    from dtrain.costmodel.calibration_probe import from_probe
    from dtrain.costmodel.calibration_records import Source

    pts = [
        {"flops": 1.1e12, "count": 1, "fraction": 0.74, "seconds": 1.5e-3},
        {"flops": 1.37e11, "count": 1, "fraction": 0.70, "seconds": 2e-4},
        {"flops": 5.5e11, "count": 1, "fraction": 0.76, "seconds": 7e-4},
        {"flops": 9.7e9, "count": 1, "fraction": 0.20, "seconds": 5e-5},  # < 100 us: left out
        {"flops": 1.3e10, "count": 96, "fraction": 0.14, "seconds": 9e-4},
    ]  # batched: left out
    h100 = Source("gpu/gemm-probe", "2026-11-25", "cuda", "none", 1, "NVIDIA H100 80GB HBM3")
    got = {c.name: c.value for c in from_probe({"points": pts, "dtype": "bfloat16"}, h100)}
    want = sorted(
        f * (w + 4.8e9) / w for w, f in [(1.1e12, 0.74), (1.37e11, 0.70), (5.5e11, 0.76)]
    )[1]
    assert got == {"mfu": pytest.approx(want), "gemm_half_flops": 4.8e9}
    unknown = Source("gpu/gemm-probe", "2026-11-25", "cuda", "none", 1, "NVIDIA RTX 4090")
    got = {c.name: c.value for c in from_probe({"points": pts, "dtype": "bfloat16"}, unknown)}
    assert got["gemm_half_flops"] != 4.8e9 and 0.7 < got["mfu"] < 0.8
