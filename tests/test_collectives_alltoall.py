"""The cost model's all-to-all (issue 38): even and uneven splits priced from the link's own
α–β, by hand, and allreduce-bench's all_to_all fit reaching calibration as the link's model."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dtrain.costmodel.calibrate import calibrate
from dtrain.costmodel.calibration_links import from_allreduce
from dtrain.costmodel.calibration_records import Source
from dtrain.costmodel.collectives import all_to_all_time, all_to_all_uneven_time
from dtrain.costmodel.hardware import LinkModel
from dtrain.results import contract, contract_records
from dtrain.results.metrics import write_summary

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"
LINK = LinkModel(1e-5, 2e9, "host")
FITTED = LinkModel(1e-5, 2e9, "host", (("all_to_all", 4e-5, 1e9),))


def test_even_all_to_all_by_hand():
    # 4 ranks, an 8 MB send buffer: 3/4 of it leaves the rank at β = 2 GB/s, 3 peers' α
    assert all_to_all_time(8e6, 4, LINK) == pytest.approx(0.75 * 8e6 / 2e9 + 3 * 1e-5)
    assert all_to_all_time(8e6, 1, LINK) == 0.0


def test_even_all_to_all_uses_the_links_own_fit():
    assert all_to_all_time(8e6, 4, FITTED) == pytest.approx(0.75 * 8e6 / 1e9 + 3 * 4e-5)


def test_beta_is_the_nccl_tests_bus_bandwidth():
    """With α = 0, busbw = algbw · (n−1)/n (algbw = send buffer / time) is the link's β."""
    link = LinkModel(0.0, 3e9)
    t = all_to_all_time(6e6, 8, link)
    assert 6e6 / t * 7 / 8 == pytest.approx(3e9)


def test_uneven_all_to_all_the_busiest_sender_sets_the_time():
    sends = [
        [0, 1e6, 3e6],  # rank 0 sends 4 MB: the busiest
        [2e6, 0, 0],
        [1e6, 1e6, 0],
    ]  # receives: rank 0 3 MB, rank 1 2 MB, rank 2 3 MB
    assert all_to_all_uneven_time(sends, LINK) == pytest.approx(4e6 / 2e9 + 2 * 1e-5)


def test_uneven_all_to_all_the_busiest_receiver_sets_the_time():
    # rank 0 receives 10 MB; rank 1's 7 MB to itself stays home
    sends = [[0, 0, 0], [5e6, 7e6, 0], [5e6, 0, 0]]
    assert all_to_all_uneven_time(sends, FITTED) == pytest.approx(1e7 / 1e9 + 2 * 4e-5)


def test_even_splits_through_the_uneven_form_give_the_even_time():
    n, buf = 4, 8e6
    sends = [[buf / n] * n for _ in range(n)]
    assert all_to_all_uneven_time(sends, FITTED) == pytest.approx(all_to_all_time(buf, n, FITTED))
    assert all_to_all_uneven_time([[5.0]], LINK) == 0.0


@pytest.mark.parametrize("sends", [[[0, 1], [1]], [[0, -1], [1, 0]]])
def test_uneven_all_to_all_refuses_a_bad_matrix(sends):
    with pytest.raises(ValueError, match="all_to_all sends must be a square matrix of bytes >= 0"):
        all_to_all_uneven_time(sends, LINK)


def _a2a_fit(world_size: int = 4) -> contract_records.CollectiveFit:
    where = contract_records.where_of("cpu", "gloo", None)
    return contract_records.CollectiveFit(
        collective="all_to_all",
        link_class="intra_node",
        dtype="float32",
        world_size=world_size,
        alpha_us=90.0,
        beta_GBps=1.2,
        r2=0.99,
        n_points=7,
        algo_factor=0.75,
        theoretical_GBps=None,
        beta_pct_of_theoretical=None,
        where=where,
    )


def test_from_allreduce_keeps_the_all_to_all_fit_alpha_per_peer():
    src = Source("cpu/allreduce-bench", "2025-03-01", "cpu", "gloo", 4, None)
    got = {c.name: c.value for c in from_allreduce([_a2a_fit()], src)}
    # a whole 4-rank all_to_all's α is 3 peers' worth
    assert got == {
        "intra_all_to_all_alpha_s": pytest.approx(30e-6),
        "intra_all_to_all_beta_Bps": pytest.approx(1.2e9),
    }


def test_a_measured_all_to_all_becomes_the_links_all_to_all(tmp_path):
    """The fixture's allreduce-bench run plus an all_to_all fit: the local link prices all-to-alls
    with it; without the fit the link's all-reduce α–β does, as for the other collectives."""
    assert calibrate([CPU], warn=False).local_links["intra"].of(
        "all_to_all"
    ).alpha_s == pytest.approx(31.25e-6)  # not fitted: the all-reduce's α per hop
    shutil.copytree(CPU / "allreduce-bench", tmp_path / "cpu" / "allreduce-bench")
    [run] = [p for p in (tmp_path / "cpu" / "allreduce-bench").iterdir() if p.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    records = contract.read(summary)
    write_summary(run, {**summary, "guide_inputs": [*records, _a2a_fit()]})
    link = calibrate([tmp_path / "cpu"], warn=False).local_links["intra"]
    a2a = link.of("all_to_all")
    assert (a2a.alpha_s, a2a.beta_Bps) == (pytest.approx(30e-6), pytest.approx(1.2e9))
    assert all_to_all_time(4e6, 4, link) == pytest.approx(0.75 * 4e6 / 1.2e9 + 3 * 30e-6)
    ag = link.of("all_gather")  # the fixture's own all_gather fit is untouched
    assert (ag.alpha_s, ag.beta_Bps) == (pytest.approx(48e-6), pytest.approx(1.9e9))
    assert dataclasses.asdict(records[0])["collective"] == "all_reduce"
