"""dtrain.costmodel.calibrate: measured over datasheet, provenance, and the CPU/GPU rule."""
import json
import shutil
from pathlib import Path

import pytest

from dtrain.costmodel import Cluster, LinkModel
from dtrain.costmodel.calibrate import calibrate, tp_modelled_comm_s

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
    assert all(p.provenance.startswith("datasheet/published:") for p in vars(rep.cluster_links).values())
    # the incomplete run is not read
    assert not any("crashed" in str(r.path) for r in rep.runs) and len(rep.runs) == 6


def test_local_values_and_provenance_by_hand():
    rep = calibrate([CPU], base=FIXTURES, warn=False)
    zero3 = CPU / "fsdp-scaling/20250301-100100-000001"
    g = _summary(zero3)["guide"]
    # compute-only efficiency: the time model costs the exposed communication separately
    assert rep.local.mfu.value == pytest.approx(g["mfu"] * g["step_time_s"] / (g["step_time_s"] - g["exposed_comm_s"]))
    assert rep.local.mfu.provenance.startswith("measured here: cpu/fsdp-scaling/20250301-100100-000001, "
                                               "2025-03-01T10:01:01+00:00, cpu")
    assert rep.local.dp_overlap.value == 0.46  # only sharded strategies measure overlap (ddp's is null)
    # fp8: the fastest recipe within the loss noise band wins, not the fastest overall
    assert rep.local.fp8_speedup.value == 0.71 and "recipe emulated" in rep.local.fp8_speedup.provenance
    assert rep.local.fp8_memory_factor.value == 1.06
    link = rep.local_links["intra"]
    # the fit's 62.5 µs is a whole 2-rank all_reduce: 2(n-1) = 2 ring hops, so 31.25 µs per hop
    assert (link.alpha_s, link.beta_Bps) == (pytest.approx(31.25e-6), pytest.approx(1.6e9))
    assert "inter" not in rep.local_links  # one host: no inter-node fit
    assert rep.keep_bf16_local[0] == ["blocks.0.attn.wq", "lm_head"]
    assert rep.keep_bf16[1].startswith("datasheet/published:")  # CPU numerics do not set the cluster's


def test_tp_overhead_is_measured_over_alpha_beta_comm_time():
    rep = calibrate([CPU], base=FIXTURES, warn=False)
    link = LinkModel(31.25e-6, 1.6e9)
    # block = 2 TP regions; 4 collectives per region fwd+bwd, 2(n-1) hops each at n = 2
    modelled = 4194304 / 1.6e9 + 4 * 2 * 1 * 31.25e-6
    assert tp_modelled_comm_s({"tp": 2, "comm_bytes_per_layer": 4194304}, link, 2) == pytest.approx(modelled)
    ratios = sorted([0.125 * 0.22 / modelled, 0.13 * 0.24 / modelled])
    assert rep.local.tp_overhead.value == pytest.approx(ratios[1])  # median of two = the upper one


def test_gpu_runs_win_for_the_matrix_and_cpu_values_stay_local():
    rep = calibrate([CPU, GPU], base=FIXTURES, warn=False)
    assert rep.measured_on_gpu
    assert rep.cluster.mfu.provenance.startswith("measured here: gpu/fsdp-scaling/")
    assert "NVIDIA H100 80GB HBM3 (nccl, 8 ranks)" in rep.cluster.mfu.provenance
    assert rep.cluster.dp_overlap.value == 0.81
    assert rep.cluster.tp_overhead.provenance.startswith("datasheet/published:")  # no GPU tp-attention run
    links = rep.cluster_links
    assert links.intra_efficiency.value == pytest.approx(0.8) and links.inter_efficiency.value == pytest.approx(0.82)
    assert links.intra_alpha_s.value == pytest.approx(14e-6 / 30)  # 16-rank fit: 2(n-1) = 30 hops
    # the local (any device) calibration still takes the latest value: here the GPU one is newer
    assert rep.local.mfu.provenance == rep.cluster.mfu.provenance


def test_link_calibration_scales_the_nominal_rates():
    rep = calibrate([GPU], base=FIXTURES, warn=False)
    c = rep.cluster_links.apply(Cluster.from_profile("h100-sxm", 64, 8, ib_gbit_per_gpu=400))
    assert c.nvlink.beta_Bps == pytest.approx(0.8 * 450e9) and c.ib.beta_Bps == pytest.approx(0.82 * 50e9)
    assert (c.nvlink.alpha_s, c.ib.alpha_s) == (pytest.approx(14e-6 / 30), pytest.approx(22e-6 / 30))


def test_latest_run_wins_and_study_reports_are_not_double_counted(tmp_path):
    shutil.copytree(CPU, tmp_path / "cpu")
    newer = tmp_path / "cpu/fsdp-scaling/20250305-000000-000000"
    shutil.copytree(tmp_path / "cpu/fsdp-scaling/20250301-100100-000001", newer)
    env = json.loads((newer / "env.json").read_text())
    env["created"] = "2025-03-05T00:00:00+00:00"
    (newer / "env.json").write_text(json.dumps(env))
    s = _summary(newer)
    s["guide"]["overlap_fraction"] = 0.7
    (newer / "summary.json").write_text(json.dumps(s))
    # a study report listing both zero3 runs again
    report = tmp_path / "cpu/fsdp-scaling/report"
    report.mkdir()
    (report / "config.yaml").write_text("subproject: fsdp-scaling\nreport: true\n")
    runs = [dict(_summary(p)["guide"], run=str(p)) for p in (newer, tmp_path / "cpu/fsdp-scaling/20250301-100100-000001")]
    (report / "summary.json").write_text(json.dumps({"guide": {"runs": runs, "scaling_efficiency": {}}}))
    rep = calibrate([tmp_path / "cpu"], base=tmp_path, warn=False)
    assert rep.local.dp_overlap.value == 0.7 and "2025-03-05" in rep.local.dp_overlap.provenance
    overlaps = [c for c in rep.candidates if c.name == "dp_overlap"]
    assert len(overlaps) == 2  # one per zero3 run, none from the report's copies


def test_missing_results_path_raises():
    with pytest.raises(FileNotFoundError, match="no such results path"):
        calibrate(["/nonexistent/results"])


def test_gemm_probe_overheads_give_the_local_step_overhead(tmp_path):
    probe = tmp_path / "gemm-probe"
    probe.mkdir()
    (probe / "config.yaml").write_text("subproject: gemm-probe\ndevice: cpu\nthreads: 1\n")
    (probe / "env.json").write_text(json.dumps({"created": "2030-01-01T00:00:00+00:00", "device": "cpu",
                                                "backend": "none", "world_size": 1}))
    over = [{"kind": "gpt", "config": {"n_layer": n, "d_model": 64}, "micro_batch": 1, "tp": 1,
             "step_s": s + 0.001, "gemm_s": 0.001, "overhead_s": s} for n, s in ((2, 0.004), (4, 0.010), (8, 0.030))]
    (probe / "summary.json").write_text(json.dumps({"guide": {"device": "cpu", "dtype": "float32", "e_max": 0.9,
                                                              "w_half": 1e5, "points": [], "overheads": over}}))
    rep = calibrate([tmp_path], base=tmp_path, warn=False)
    assert rep.local.step_overhead_s.value == pytest.approx(0.010)  # median of the three models
    assert "GPT 2x64 mb1 4.0 ms" in rep.local.step_overhead_s.provenance
    assert rep.cluster.step_overhead_s.value == 0.0  # a CPU probe does not set the GPU matrix's
