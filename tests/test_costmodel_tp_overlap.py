"""TP's hidden share on tuned stacks (costmodel/tp_overlap.py, issue 39): TE's ring-exchange,
pipelined and bulk overlaps by hand, and ``dtrain plan --explain-tp``."""

from __future__ import annotations

import pytest

from dtrain.cli.main import main
from dtrain.costmodel.tp_overlap import (
    TPOverlap,
    bulk_exposed,
    gpu_sms,
    layer_overlap,
    pipeline_exposed,
    ring_exposed,
)


def test_each_overlap_by_hand():
    # ring exchange over 4 ranks: 3 of the 4 GEMM chunks cover the gather
    assert ring_exposed(2.0, 3.0, 4) == 0.0  # 2.25 of GEMM covers 2
    assert ring_exposed(2.0, 1.0, 4) == pytest.approx(2.0 - 0.75)
    # pipelined reduce-scatter in 4 chunks: the last chunk's transfer always shows
    assert pipeline_exposed(2.0, 8.0) == pytest.approx(0.5)
    assert pipeline_exposed(2.0, 1.0) == pytest.approx(2.0 - 0.75)  # 3·(0.5 − 0.25) + 0.5
    # bulk: the whole transfer beside the whole GEMM
    assert bulk_exposed(2.0, 3.0) == 0.0 and bulk_exposed(2.0, 1.5) == pytest.approx(0.5)


def test_one_layer_by_hand():
    """GEMMs (forward ms) qkv 3, proj 1, fc1 4, fc2 4; one gather and one reduce-scatter 2 ms each;
    tp 4; an H100's 132 SMs (16 held: the GEMM runs on 116); copies cost 0.1 of hidden time."""
    gemms = {"qkv": 3.0, "proj": 1.0, "fc1": 4.0, "fc2": 4.0}
    got = layer_overlap(gemms, 2.0, 2.0, 4, 132, 0.1)
    slow = 132 / 116  # a GEMM beside a pipelined or bulk overlap
    exposed = (
        0.0  # qkv fprop gather: 2 ≤ 3·3/4
        + 0.0  # fc1 fprop gather: 2 ≤ 4·3/4
        + (2.0 - 1.0 * slow * 3 / 4)  # proj fprop reduce-scatter, 4 chunks
        + 0.5  # fc2 fprop reduce-scatter: its last chunk, 2/4
        + (2.0 - 1.0 * 3 / 4)  # proj dgrad gather
        + 0.0  # fc2 dgrad gather
        + 0.0  # qkv wgrad bulk reduce-scatter: 2 ≤ 3·slow
        + 0.0  # fc1 wgrad bulk: 2 ≤ 4·slow
    )
    sm = (1.0 + 4.0 + 3.0 + 4.0) * (slow - 1)  # proj, fc2 forward; qkv, fc1 wgrad
    assert got.exposed == pytest.approx(exposed)
    assert got.hidden == pytest.approx(8 * 2.0 - exposed)  # 8 collectives of 2 ms
    assert got.sm_cost == pytest.approx(sm) and sm == pytest.approx(12 * 16 / 116)
    assert got.copy_cost == pytest.approx(0.1 * got.hidden)
    assert got.total == pytest.approx(exposed + sm + 0.1 * got.hidden)
    # full recompute runs the forward's four overlaps again
    twice = layer_overlap(gemms, 2.0, 2.0, 4, 132, 0.1, forwards=2)
    assert twice.exposed == pytest.approx(exposed + (2.0 - slow * 3 / 4) + 0.5)
    # no SM count (the CPU): no SM cost, the GEMMs at their own time
    assert layer_overlap(gemms, 2.0, 2.0, 4, None, 0.0).sm_cost == 0.0
    assert TPOverlap(1, 2, 3, 4).times(2).plus(TPOverlap(1, 1, 1, 1)) == TPOverlap(3, 5, 7, 9)


def test_sm_counts_by_gpu():
    assert [gpu_sms(n) for n in ("a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200")] == [
        108,
        132,
        114,
        132,
        148,
    ]
    assert gpu_sms("cpu") is None


def _plan(capsys, *extra):
    rc = main(["plan", "--params", "70e9", "--gpus", "256", "--top", "0", *extra])
    return rc, capsys.readouterr()


def test_explain_tp_names_the_terms_within_100_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    rc, out = _plan(capsys, "--software", "megatron-core", "--tp-overlap", "--explain-tp")
    assert rc == 0, out.err
    text = out.out[out.out.index("explain-tp:") :]
    for term in (
        "compute",
        "TP comm exposed",
        "TP comm hidden",
        "TP overlap SM + HBM cost",
        "DP/ZeRO comm exposed",
        "pipeline bubble + p2p",
        "memory per GPU (GiB)",
        "tp=8:",
        "what separates them",
    ):
        assert term in text, term
    assert all(len(line) <= 100 for line in out.out.splitlines())
    # the table's step row is each plan's predicted step
    step = next(line for line in text.splitlines() if line.strip().startswith("step "))
    best, at8 = (float(x) for x in step.split()[1:4:2])
    assert at8 >= best > 0


def test_explain_tp_json_and_the_overlap_flags_checked(capsys):
    import json

    rc, out = _plan(capsys, "--software", "megatron-core", "--tp-overlap", "--explain-tp", "--json")
    d = json.loads(out.out)["explain_tp"]
    assert rc == 0 and d["tp"] == 8 and " tp=8 " in d["at_tp"]["layout"]
    assert d["best"]["step"] <= d["at_tp"]["step"]
    assert d["at_tp"]["tp_hidden"] > 0  # TE's overlaps hide some of TP 8's traffic
    rc, out = _plan(capsys, "--software", "torchtitan", "--tp-overlap")
    assert rc == 2 and out.out == ""
    assert out.err.strip() == (
        "error: --tp-overlap: --software torchtitan does not run it: drop it, or pass --software "
        "megatron-core or any"
    )
