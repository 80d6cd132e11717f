"""`dtrain plan`: units, output, JSON, exit codes; and the pruned search the guide relies on."""

import json
import re
from pathlib import Path

import pytest

from conftest import py
from dtrain.cli.main import main
from dtrain.costmodel import Cluster, ModelShape, memory_per_gpu, search
from dtrain.costmodel.hardware import LINK_EFFICIENCY
from dtrain.costmodel.links import default_links

FIXTURES = Path(__file__).parent / "fixtures" / "results"
BASE = [
    "plan",
    "--params",
    "70e9",
    "--gpus",
    "512",
    "--gpus-per-node",
    "8",
    "--nvlink-gbps",
    "900",
    "--ib-gbps",
    "400",
]


def plan(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_text_output_has_choice_memory_time_and_runners_up(capsys):
    code, out, _ = plan(capsys, *BASE)
    assert code == 0
    # units: 900 GB/s bidirectional -> 450 per direction; 400 Gbit/s -> 50 GB/s; collectives reach
    # LINK_EFFICIENCY of each (the bus bandwidth the model uses)
    assert f"NVLink {450 * LINK_EFFICIENCY:.4g} GB/s per direction achieved" in out
    assert (
        f"{50 * LINK_EFFICIENCY:.4g} GB/s per GPU achieved ({400 * LINK_EFFICIENCY:.4g} Gbit/s)"
        in out
    )
    choice = re.search(r"choice:\s+dp=(\d+) tp=(\d+) pp=(\d+)", out)
    assert choice and int(choice[1]) * int(choice[2]) * int(choice[3]) == 512
    assert re.search(r"step time\s+[\d.]+ s = compute", out) and re.search(r"MFU \d+\.\d%", out)
    used, usable = map(
        float, re.search(r"memory/GPU\s+([\d.]+) GiB of ([\d.]+) GiB usable", out).groups()
    )
    assert used <= usable == 72.0
    assert "why the runners-up lost:" in out and "slower;" in out
    assert (
        "stack:    flash attention, fused kernels (--attention" in out
    )  # the software it assumed, said


def test_json_answer_matches_a_direct_search(capsys):
    code, out, _ = plan(capsys, *BASE, "--json")
    assert code == 0
    ans = json.loads(out)
    assert ans["fits"] and ans["cluster"]["intra_node_GBps_per_direction"] == pytest.approx(
        450 * LINK_EFFICIENCY
    )
    assert ans["cluster"]["inter_node_Gbps_per_gpu"] == pytest.approx(400 * LINK_EFFICIENCY)
    shape = ModelShape.from_params(70e9)
    direct = search(
        shape, default_links().apply(Cluster.from_profile("h100-sxm", 512, 8, 400, 450)), 1024
    ).best
    c = ans["choice"]
    assert c["describe"] == direct.describe()
    assert c["step_time_s"]["total"] == pytest.approx(direct.time.total)
    assert c["memory_bytes"]["total"] == pytest.approx(memory_per_gpu(shape, direct).total)
    assert ans["calibration"]["mfu"]["provenance"].startswith("datasheet/published:")


def test_shape_flags_and_gpu_choice(capsys):
    code, out, _ = plan(
        capsys,
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
        "2048",
        "--gpus",
        "16",
        "--gpu",
        "a100-80gb",
        "--global-batch",
        "256",
        "--json",
    )
    ans = json.loads(out)
    assert code == 0 and ans["model"]["kv_heads"] == 8 and ans["model"]["seq"] == 2048
    assert ans["cluster"]["gpu"] == "a100-80gb" and ans["cluster"][
        "intra_node_GBps_per_direction"
    ] == pytest.approx(300 * LINK_EFFICIENCY)
    assert ans["choice"]["dp"] * ans["choice"]["micro_batch"] * ans["choice"]["grad_accum"] == 256


def test_does_not_fit_is_exit_1_with_a_clear_line(capsys):
    code, out, err = plan(capsys, "plan", "--params", "405e9", "--gpus", "8", "--gpu", "a100-40gb")
    assert code == 1
    assert re.search(
        r"does not fit: even the smallest plan .* needs [\d.]+ GiB per GPU > 36.0 GiB usable",
        " ".join(out.split()),  # wrapped by words within 100 columns
    )
    assert "hint:" in err
    code, out, _ = plan(
        capsys, "plan", "--params", "405e9", "--gpus", "8", "--gpu", "a100-40gb", "--json"
    )
    assert code == 1 and json.loads(out)["fits"] is False and json.loads(out)["choice"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--params", "7e9", "--gpus", "12"], "not a whole number of 8-GPU nodes"),
        (["--params", "7e9", "--layers", "4", "--gpus", "8"], "either --params or the shape"),
        (["--layers", "4", "--gpus", "8"], "needs --params, or all of"),
        (
            ["--params", "-1", "--gpus", "8"],
            "argument --params: '-1' is not a positive parameter count (70e9, 70B, 350M, 1T)",
        ),
        (
            ["--layers", "4", "--hidden", "100", "--heads", "3", "--gpus", "8"],
            "--hidden 100 is not divisible by --heads 3 (head dim must be a whole number)",
        ),
        (
            ["--params", "7e9", "--gpus", "8", "--gpu", "a100-80gb", "--precision", "fp8"],
            "no FP8 tensor cores",
        ),
        (
            ["--params", "7e9", "--gpus", "8", "--ib-gbps", "0"],
            "argument --ib-gbps: 0 must be a finite number > 0",
        ),
        (
            ["--params", "7e9", "--gpus", "8", "--power-w", "60"],
            "--power-w 60 is at or below h100-sxm's idle draw (78 W): give the board's power "
            "limit in W",
        ),
        (
            ["--params", "7e9", "--gpus", "8", "--tp-overlap", "--async-tp"],
            "--tp-overlap (Megatron / TransformerEngine) and --async-tp (torchtitan) are two "
            "stacks",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, args, message):
    code, out, err = plan(capsys, "plan", *args)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_results_calibrate_from_gpu_runs_only(capsys):
    code, out, _ = plan(capsys, *BASE, "--results", str(FIXTURES / "cpu"), "--json")
    ans = json.loads(out)
    assert code == 0 and ans["calibration"]["mfu"]["provenance"].startswith("datasheet/published:")
    assert any("measured on CPU ignored" in n for n in ans["notes"])
    code, out, _ = plan(capsys, *BASE, "--results", str(FIXTURES / "gpu"), "--json")
    ans = json.loads(out)
    # a GPU training run calibrates the DP overlap and the links; its MFU checks the GEMM curve, it
    # does not set it (only a CUDA gemm-probe does: test_gpu_probe_sets_the_gemm_curve)
    assert ans["calibration"]["dp_overlap"]["provenance"].startswith("measured here:")
    assert ans["calibration"]["mfu"]["provenance"].startswith("datasheet/published:")
    assert ans["cluster"]["intra_node_GBps_per_direction"] == pytest.approx(0.8 * 450)


def test_console_script_exit_codes():
    ok = py("-m", "dtrain.cli.main", "plan", "--params", "7e9", "--gpus", "8", timeout=60)
    assert ok.returncode == 0 and "choice:" in ok.stdout
    bad = py("-m", "dtrain.cli.main", "plan", "--params", "7e9", "--gpus", "12", timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:")


@pytest.mark.parametrize(
    "params, gpus, gpu, link",
    [
        (7e9, 8, "h100-sxm", None),
        (70e9, 256, "h100-sxm", 32),
        (13e9, 64, "a100-80gb", None),
        (405e9, 1024, "h200", None),
    ],
)
def test_pruned_search_finds_the_same_best(params, gpus, gpu, link):
    shape = ModelShape.from_params(params)
    cluster = Cluster.from_profile(gpu, gpus, 8, ib_gbit_per_gpu=100, nvlink_gbps_per_dir=link)
    full, pruned = search(shape, cluster, 512), search(shape, cluster, 512, prune=True)
    assert (full.best is None) == (pruned.best is None)
    if full.best is not None:
        assert pruned.best.describe() == full.best.describe()
        assert pruned.best.time.total == full.best.time.total
        assert len(pruned.ranked) < len(full.ranked)


# A 32B Llama-style model with FSDP on one node at 8K tokens: its states alone are 16 B/param / 8 =
# 60 GiB.
FSDP_32B = [
    "plan",
    "--layers",
    "60",
    "--hidden",
    "6656",
    "--heads",
    "52",
    "--ffn-hidden",
    "17920",
    "--gated-mlp",
    "--seq",
    "8192",
    "--gpus",
    "8",
    "--gpu",
    "h100-sxm",
    "--global-batch",
    "8",
]


def test_a_given_layout_is_judged_against_the_whole_hbm(capsys):
    """--headroom is for choosing; a layout the user gives (a published one that ran) fits if it
    fits the HBM:
    between 72 and 80 GiB it is scored and marked tight, over 80 it is one error line and exit 2."""
    code, out, _ = plan(capsys, *FSDP_32B, "--layout", "dp=8 zero=3 recompute=full mb=1", "--json")
    mine = json.loads(out)["layout"]
    total = mine["memory_bytes"]["total"] / 2**30
    assert code == 0 and mine["fits"] and mine["tight"] and 72.0 < total <= 80.0
    assert mine["hbm_usable_bytes"] == 80 * 2**30 and mine["tokens_per_s"] > 0
    code, out, _ = plan(capsys, *FSDP_32B, "--layout", "dp=8 zero=3 recompute=full mb=1")
    assert code == 0 and re.search(r"memory/GPU\s+7[2-9]\.\d GiB of 80\.0 GiB usable", out)
    assert "caution     fits only in the HBM that --headroom keeps free" in out
    code, out, err = plan(capsys, *FSDP_32B, "--layout", "dp=8 zero=3 recompute=none mb=1")
    assert code == 2 and err.startswith(
        'error: your layout "dp=8 zero=3 recompute=none mb=1" cannot run: does not fit'
    )
    assert re.search(r"needs [\d.]+ GiB per GPU > 80\.0 GiB usable", err) and err.count("\n") == 1
    code, out, _ = plan(
        capsys,
        *FSDP_32B,
        "--layout",
        "dp=8 zero=3 recompute=full mb=1",
        "--headroom",
        "0",
        "--json",
    )
    assert code == 0 and json.loads(out)["layout"]["tight"] is False


def _bench_module():
    import importlib.machinery
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench-costmodel"
    loader = importlib.machinery.SourceFileLoader("bench_costmodel", str(path))
    spec = importlib.util.spec_from_loader("bench_costmodel", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_bench_refuses_to_time_a_command_that_failed(tmp_path, monkeypatch, capsys):
    """A command that exits non-zero (an interpreter without dtrain's dependencies answers in 40
    ms) is an error line and exit 2, not a time; the bench's own folder is removed, nothing else
    is touched."""
    import sys

    bench = _bench_module()
    failing = [sys.executable, "-c", "import sys; sys.exit('no module named rich')"]
    monkeypatch.setattr(bench, "commands", lambda out: {"plan 405B on 8192 GPUs": failing})
    monkeypatch.setattr(
        sys, "argv", ["bench-costmodel", "--repeat", "1", "--out", str(tmp_path / "bench")]
    )
    assert bench.main() == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ")
        and "exited 1" in err
        and "no module named rich" in err
        and err.count("\n") == 1
    )
    assert list((tmp_path / "bench").iterdir()) == []


@pytest.mark.parametrize(
    "written, count", [("70B", 70e9), ("1.3b", 1.3e9), ("350M", 350e6), ("2T", 2e12), ("7e9", 7e9)]
)
def test_params_takes_the_size_as_people_write_it(written, count):
    from dtrain.costmodel.plan_args import param_count

    assert param_count(written) == pytest.approx(count, rel=1e-12)


@pytest.mark.parametrize("written", ["70X", "B", "0B", "nanB", "-7B"])
def test_params_with_a_wrong_size_is_one_line(capsys, written):
    code = main(["plan", "--params", written, "--gpus", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and len(err) == 1 and err[0].startswith("error: dtrain plan: argument --params:")
    )


def test_an_interpolated_trillion_parameter_shape_is_named_in_t():
    assert ModelShape.from_params(2e12).name == "~2T (interpolated)"
    assert ModelShape.from_params(1.3e9).name == "~1.3B (interpolated)"


def test_a_power_cap_is_shown_as_its_term(capsys):
    """--power-w below the table's board power prints the term it costs: ((700 - 78)/(500 -
    78))^(1/3) = 1.138 for an H100 SXM capped to 500 W (the 78 W idle draw is kernels.yaml's);
    without a cap, no such line."""
    code, out, _ = plan(
        capsys, "plan", "--params", "8e9", "--gpus", "8", "--power-w", "500", "--hbm-gib", "96"
    )
    line = [x for x in out.replace("\n          ", " ").splitlines() if x.startswith("power:")]
    assert code == 0 and len(line) == 1  # (its continuation lines joined: wrapped by words)
    assert f"x{(622 / 422) ** (1 / 3):.3f} the time" in line[0] and "x1.138" in line[0]
    assert "500 W cap of the 700 W" in line[0] and "78 W idle" in line[0]
    code, out, _ = plan(capsys, "plan", "--params", "8e9", "--gpus", "8", "--json")
    assert code == 0 and json.loads(out)["cluster"]["power_note"] is None
    code, out, _ = plan(capsys, "plan", "--params", "8e9", "--gpus", "8")
    assert not any(x.startswith("power:") for x in out.splitlines())


def test_deepspeed_gradient_accumulation_is_named_in_text_and_json(capsys):
    """`--software megatron-deepspeed` with fp32 gradient accumulation (its BF16_Optimizer) prices
    an fp32 copy per micro-batch: the text names it inside the memory-bound term, the JSON carries
    the same seconds as the direct step time of that layout."""
    from dtrain.costmodel import Layout, step_time
    from dtrain.costmodel.stack import Stack

    args = [
        "plan", "--layers", "8", "--hidden", "2048", "--heads", "16", "--seq", "2048",
        "--gpus", "32", "--gpu", "a100-80gb", "--global-batch", "64",
        "--software", "megatron-deepspeed", "--dp-sync", "flush",
        "--layout", "dp=2 tp=4 pp=4 zero=1 recompute=full mb=1",
    ]  # fmt: skip
    code, out, _ = plan(capsys, *args)
    assert code == 0
    accum = re.search(r"memory-bound [\d.]+ \(of it gradient\s+accumulation ([\d.]+)\)", out)
    assert accum and float(accum[1]) > 0
    code, out, _ = plan(capsys, *args, "--json")
    layout = json.loads(out)["layout"]
    assert layout["grad_accum"] == 32
    got = layout["step_time_s"]["grad_accum"]
    assert got == pytest.approx(float(accum[1]), abs=5e-4)
    # ZeRO-1 keeps every stage parameter's fp32 gradient: 18 B each, all 32 micro-batches
    shape = ModelShape(8, 2048, 16, 16, 32000, 2048)
    lay = Layout(dp_shard=2, tp=4, pp=4, zero_stage=1, recompute="full", grad_accum=32)
    cluster = default_links().apply(Cluster.from_profile("a100-80gb", 32, 8))
    direct = step_time(shape, lay, cluster, stack=Stack(software="megatron-deepspeed"))
    assert got == pytest.approx(direct.grad_accum)
