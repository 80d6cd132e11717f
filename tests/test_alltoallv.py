"""allreduce-bench's uneven all-to-all (all_to_all_v, expert parallelism's dispatch): the routing
skews by hand, nccl-tests' all-to-all byte and bus convention, the correctness check over 2 gloo
ranks with a hot expert, bad knobs as one-line errors, and its α–β fit reaching calibration as
the link's own all_to_all_v beside the even all_to_all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from allreduce_bench import alltoallv, busbw, spec
from dtrain.core.errors import UserError
from dtrain.costmodel.calibrate import calibrate
from dtrain.results import contract, contract_records
from dtrain.results.metrics import write_summary

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"


def test_rows_per_rank_are_tokens_times_top_k_and_skew_raises_imbalance():
    got = {}
    for skew in alltoallv.SKEWS:
        r = alltoallv.Routing(skew=skew, tokens=512, top_k=2, experts_per_rank=4)
        rows = alltoallv.send_matrix(r, 4)
        assert all(sum(row) == 512 * 2 for row in rows)
        assert rows == alltoallv.send_matrix(r, 4)  # every rank recomputes the same matrix
        got[skew] = alltoallv.imbalance(rows)
    print(got)
    assert 1.0 <= got["uniform"] < 1.1 < got["zipf"]
    # hot: expert 0 (rank 0) takes about half of the first choices: rank 0 receives ~ n x more
    assert got["hot"] > 1.5


def test_imbalance_by_hand():
    # rank 1 receives 3 + 4 = 7 rows, the balanced count is (4 + 6) / 2 = 5
    assert alltoallv.imbalance([[1, 3], [2, 4]]) == pytest.approx(7 / 5)


def test_each_buffer_is_apportioned_as_its_rows_are():
    assert alltoallv.apportion(10, [1, 1, 1]) == [4, 3, 3]  # largest remainders, then low index
    assert alltoallv.apportion(7, [5, 0, 2]) == [5, 0, 2]
    r = alltoallv.Routing(tokens=8, top_k=2)
    lay = alltoallv.layout(1000, 4, 4)  # 250 elements, as the even all-to-all's buffer
    assert (lay.count, lay.nbytes) == (250, 1000)
    assert alltoallv.layout(2, 4, 4).count == 1  # at least one element
    assert busbw.bus_factor("all_to_all_v", 4) == 0.75 == busbw.bus_factor("all_to_all", 4)
    rows = alltoallv.send_matrix(r, 4)
    ins, outs = alltoallv.splits(r, lay, 1)
    assert sum(ins) == 250 and ins == alltoallv.apportion(250, rows[1])
    assert outs == [alltoallv.apportion(250, rows[i])[1] for i in range(4)]


@pytest.mark.parametrize(
    "knob, message",
    [
        ({"skew": "pareto"}, "alltoallv.skew='pareto' must be one of uniform, zipf, hot"),
        (
            {"top_k": 5},
            "alltoallv.top_k=5 is more than alltoallv.experts_per_rank=4: each token picks "
            "top_k distinct experts",
        ),
        ({"hot_share": 1.0}, "alltoallv.hot_share=1.0 must be a number in (0, 1)"),
        ({"tokens": 0}, "alltoallv.tokens=0 must be an integer >= 1"),
    ],
)
def test_bad_routing_knobs_are_one_line_errors(knob, message):
    with pytest.raises(UserError) as e:
        spec._routing(OmegaConf.create(knob))
    assert str(e.value) == message


def test_two_ranks_hot_expert_run_is_checked_and_records_its_imbalance(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "allreduce_bench",
        "world_size=2",
        "collectives=[all_to_all_v]",
        "max_bytes=64K",
        "iters=2",
        "alltoallv.skew=hot",
        f"results_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [summary] = tmp_path.rglob("summary.json")
    s = json.loads(summary.read_text())
    assert s["alltoallv"]["skew"] == "hot" and s["alltoallv"]["imbalance"]["intra_node"] > 1.2
    rows = [json.loads(line) for line in (summary.parent / "records.jsonl").open()]
    cases = [r for r in rows if r.get("kind") == "collective"]
    assert cases and all(r["wrong"] == 0 and r["collective"] == "all_to_all_v" for r in cases)
    assert all(r["bus_factor"] == 0.5 for r in cases)


def _fit(collective: str, alpha_us: float, beta: float) -> contract_records.CollectiveFit:
    return contract_records.CollectiveFit(
        collective=collective,
        link_class="intra_node",
        alpha_us=alpha_us,
        beta_GBps=beta,
        r2=0.99,
        n_points=6,
        algo_factor=0.5,
        dtype="float32",
        world_size=4,
        theoretical_GBps=None,
        beta_pct_of_theoretical=None,
        where=contract_records.where_of("cpu", "gloo"),
    )


def test_an_all_to_all_v_fit_becomes_the_links_own_beside_the_even_one(tmp_path):
    shutil.copytree(CPU / "allreduce-bench", tmp_path / "cpu" / "allreduce-bench")
    [run] = [p for p in (tmp_path / "cpu" / "allreduce-bench").iterdir() if p.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    records = contract.read(summary)
    fits = [_fit("all_to_all", 90.0, 1.2), _fit("all_to_all_v", 120.0, 0.8)]
    write_summary(run, {**summary, "guide_inputs": [*records, *fits]})
    link = calibrate([tmp_path / "cpu"], warn=False).local_links["intra"]
    even, uneven = link.of("all_to_all"), link.of("all_to_all_v")
    assert (even.alpha_s, even.beta_Bps) == (pytest.approx(30e-6), pytest.approx(1.2e9))
    assert (uneven.alpha_s, uneven.beta_Bps) == (pytest.approx(40e-6), pytest.approx(0.8e9))
