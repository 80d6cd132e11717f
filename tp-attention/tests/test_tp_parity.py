"""Hand-rolled TP == the single-device dtrain.model.gpt, on 4 gloo ranks (oversubscribed on 2
cores).

One `python -m tp_attention.parity` launch checks every operator, the hidden-dim gather/scatter
layer path, and for tp in {1, 2, 4} x {MHA, GQA kv >= tp, GQA kv < tp} x {SP off, on} a block or
attention with random shapes (a fresh seed per test run, printed for reproduction): output,
input grad and every parameter shard's grad within 1e-5 relative, the counted collective bytes
equal to the analytic ones, and the DTensor baseline equal too where it can shard the heads.
"""

from __future__ import annotations

import json
import random

from conftest import py
from dtrain.results import loader

LAYOUTS = {
    1: {"mha", "gqa_kv_ge_tp"},
    2: {"mha", "gqa_kv_ge_tp", "gqa_kv_lt_tp"},
    4: {"mha", "gqa_kv_ge_tp", "gqa_kv_lt_tp"},
}


def test_parity_tp_1_2_4_random_shapes(tmp_path):
    seed = random.randrange(1 << 30)
    print(f"parity seed={seed} (rerun: python -m tp_attention.parity seed={seed})")
    out = py(
        "-m",
        "tp_attention.parity",
        "world_size=4",
        "train.tp=[1,2,4]",
        f"seed={seed}",
        f"results_dir={tmp_path}",
        timeout=240,
    )
    assert out.returncode == 0, f"seed={seed}\n{out.stdout}\n{out.stderr[-4000:]}"
    [run] = loader.complete_runs([tmp_path])
    assert run.summary["passed"] and run.summary["max_rel_err"] <= 1e-5

    cases = loader.load([tmp_path], kind="case")
    seen = {(r.tp, r.layout, r.sequence_parallel) for r in cases.itertuples()}
    expected = {
        (tp, lay, sp) for tp, lays in LAYOUTS.items() for lay in lays for sp in (False, True)
    }
    assert seen == expected
    assert (cases.max_rel_err <= 1e-5).all()
    assert (cases.analytic_activation == cases.counted_activation).all()
    assert (cases.analytic_grad_sync == cases.counted_grad_sync).all()
    multi = cases[cases.tp > 1]
    assert (multi.counted_activation > 0).all()
    assert (multi[multi.layout == "gqa_kv_lt_tp"].counted_grad_sync > 0).all()
    for r in cases.itertuples():  # every parameter shard's gradient was compared
        names = set(r.errors)
        assert {"out", "input_grad"} <= names and any(n.startswith("grad.") for n in names)
        if r.layout != "gqa_kv_lt_tp":
            assert any(n.startswith("dtensor.grad.") for n in names)

    ops = loader.load([tmp_path], kind="ops")
    assert set(ops.tp) == {1, 2, 4} and (ops.max_rel_err <= 1e-5).all()
    names = set().union(*ops.errors.map(set))
    for op in (
        "copy_to_region",
        "reduce_from_region",
        "gather_from_hidden",
        "scatter_to_hidden",
        "gather_from_sequence",
        "reduce_scatter_to_sequence",
        "scatter_to_sequence",
    ):
        assert {f"{op}.out", f"{op}.grad"} <= names
    layers = loader.load([tmp_path], kind="layers")
    assert (layers.max_rel_err <= 1e-5).all()
    assert json.loads((run.path / "summary.json").read_text())["checks"] > 100
