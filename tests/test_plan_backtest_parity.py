"""`dtrain plan --layout` and `dtrain backtest` are one model: every development row, given to
the CLI with its shape, cluster, software stack and whole layout as flags, gets the backtest's
own prediction (with the default calibration, `backtest(loo=False)`) and its fit verdict. A
published layout scored from the command line (how the held-out runs are scored) is the number
the backtest reports."""

import contextlib
import io
import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel.backtest import backtest
from dtrain.costmodel.published_runs import load_rows

ROWS = [r for r in load_rows() if not r.get("expect_oom")]
# The fast path scores each source's first row (dropout and learned positions, a GPU variant, FP8,
# layouts over HBM) plus a CP x TP x PP row and an interleaved one; the slow path every row (each
# runs a whole search: 0.6 s).
FIRST = {next(r["name"] for r in ROWS if r["group"] == g) for g in {r["group"] for r in ROWS}} | {
    r["name"] for r in ROWS if "CP4 x TP8 x PP8" in r["name"] or "PP8 interleaved" in r["name"]
}
CASES = [r if r["name"] in FIRST else pytest.param(r, marks=pytest.mark.slow) for r in ROWS]


def plan_args(row: dict) -> list[str]:
    m, lay, st = row["model"], row["layout"], row.get("stack", {})
    args = [
        "plan",
        "--layers",
        str(m["layers"]),
        "--hidden",
        str(m["hidden"]),
        "--heads",
        str(m["heads"]),
        "--kv-heads",
        str(m["kv_heads"]),
        "--ffn-hidden",
        str(m["ffn"]),
        "--vocab",
        str(m["vocab"]),
        "--seq",
        str(m["seq"]),
        "--gpus",
        str(row["gpus"]),
        "--gpus-per-node",
        str(row["gpus_per_node"]),
        "--gpu",
        row["gpu"],
        "--global-batch",
        str(lay["global_batch"]),
        "--precision",
        row.get("precision", "bf16"),
        "--json",
        "--top",
        "0",
    ]
    args += ["--gated-mlp"] * bool(m.get("gated")) + ["--dropout"] * bool(m.get("dropout"))
    args += ["--no-rope"] * (m.get("rotary", True) is False)
    for key, flag in (
        ("ib_gbit_per_gpu", "--ib-gbps"),
        ("hbm_gib", "--hbm-gib"),
        ("hbm_tbps", "--hbm-tbps"),
        ("power_w", "--power-w"),
    ):
        if key in row:
            args += [flag, str(row[key])]
    for key in ("attention", "kernels", "loss"):
        if key in st:
            args += [f"--{key}", st[key]]
    args += ["--tp-overlap"] * bool(st.get("tp_overlap")) + ["--async-tp"] * bool(
        st.get("async_tp")
    )
    args += ["--fp8-all-gather", st.get("fp8_all_gather", "tp")]
    args += [
        "--grad-reduce",
        st.get("grad_reduce", "fp32"),
        "--optimizer-states",
        st.get("optimizer_states", "fp32"),
    ]
    args += ["--dp-sync", st.get("dp_sync", "overlap"), "--software", st.get("software", "any")]
    fields = {
        "dp": lay["dp"],
        "cp": lay.get("cp", 1),
        "tp": lay["tp"],
        "pp": lay["pp"],
        "v": lay.get("v", 1),
        "zero": lay["zero"],
        "recompute": lay["recompute"],
        "mb": lay["mb"],
        "sp": "on" if lay.get("sp") else "off",
        "schedule": lay.get("schedule", "1f1b"),
    }
    if fields["cp"] > 1:
        fields["cp_impl"] = lay.get("cp_impl", "ring")
    if "split" in lay:
        fields["split"] = lay["split"]
    return args + ["--layout", " ".join(f"{k}={v}" for k, v in fields.items())]


@pytest.fixture(scope="module")
def predicted():
    return {r.name: r for r in backtest(loo=False, rank=False)}


@pytest.mark.parametrize("row", CASES, ids=[r["name"] for r in ROWS])
def test_plan_layout_gives_the_backtest_prediction(row, predicted):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(plan_args(row))
    mine = json.loads(out.getvalue())["layout"]
    bt = predicted[row["name"]]
    if not bt.fits:  # over the whole HBM in both: one error line, exit 2, no throughput claimed
        assert code == 2 and not mine["fits"] and "cannot run: does not fit" in err.getvalue()
        return
    assert code in (0, 1) and mine["fits"]
    assert mine["tokens_per_s"] / row["gpus"] == pytest.approx(bt.predicted_tps, rel=1e-9)
    assert mine["memory_bytes"]["total"] / 2**30 == pytest.approx(bt.memory_gib, rel=1e-9)
