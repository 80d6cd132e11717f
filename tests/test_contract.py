"""dtrain.results.contract: the typed guide inputs round-trip through summary.json, bad ones are
refused with a message that says where, and the committed fixtures are exactly what the real
writers write."""

from __future__ import annotations

import filecmp
import importlib.util
import json
from pathlib import Path

import pytest

from dtrain.results import contract, contract_records
from dtrain.results.metrics import write_summary

FIXTURES = Path(__file__).parent / "fixtures" / "results"


def _make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_committed_fixtures_are_what_the_real_writers_write(tmp_path):
    _make_fixtures().main(tmp_path)
    for tree in ("cpu", "gpu"):
        committed, fresh = FIXTURES / tree, tmp_path / tree
        assert _files(committed) == _files(fresh)
        different = [
            str(p)
            for p in _files(fresh)
            if not filecmp.cmp(committed / p, fresh / p, shallow=False)
        ]
        assert different == [], (
            "run `python tests/fixtures/results/make_fixtures.py` and commit the result"
        )


def test_every_fixture_summary_round_trips():
    kinds = set()
    for path in sorted(FIXTURES.rglob("summary.json")):
        summary = json.loads(path.read_text())
        records = contract.read(summary)
        assert contract.encode(records) == summary["guide_inputs"], path
        kinds |= {r.kind for r in records}
    # the probe runs on the host (test_costmodel_fidelity); moe_run: tests/test_moe_contract.py
    assert kinds == set(contract_records.RECORDS) - {"gemm_probe", "moe_run"}


def _fit(**changes) -> dict:
    rec = {
        "kind": "collective_fit",
        "collective": "all_reduce",
        "link_class": "intra_node",
        "dtype": "float32",
        "world_size": 2,
        "alpha_us": 60.0,
        "beta_GBps": 1.5,
        "r2": 0.99,
        "n_points": 7,
        "algo_factor": 1.0,
        "theoretical_GBps": None,
        "beta_pct_of_theoretical": None,
        "where": {"device": "cpu", "backend": "gloo", "gpu_name": None},
    }
    return {k: v for k, v in {**rec, **changes}.items() if v != "<drop>"}


@pytest.mark.parametrize(
    "value, message",
    [
        ({"schema_version": 1, "records": [_fit()]}, None),
        (
            {"schema_version": 3, "records": []},
            "guide_inputs.schema_version=3: this dtrain reads schema 1..2",
        ),
        ([_fit()], "guide_inputs must be {'schema_version': int, 'records': [...]}"),
        (
            {"schema_version": 1, "records": [_fit(kind="fancy")]},
            "records[0]: unknown kind 'fancy'",
        ),
        (
            {"schema_version": 1, "records": [_fit(alpha_us="<drop>")]},
            "records[0] (collective_fit): missing field alpha_us",
        ),
        (
            {"schema_version": 1, "records": [_fit(colour="red")]},
            "records[0] (collective_fit): unknown field(s) colour",
        ),
        (
            {"schema_version": 1, "records": [_fit(world_size=2.5)]},
            "collective_fit).world_size=2.5 must be an integer",
        ),
        (
            {"schema_version": 1, "records": [_fit(beta_GBps=None)]},
            "collective_fit).beta_GBps is null but must be float",
        ),
        (
            {"schema_version": 1, "records": [_fit(where={"device": "cpu"})]},
            "(collective_fit).where: missing field backend",
        ),
    ],
)
def test_decode_checks_kind_fields_and_types(value, message):
    if message is None:
        [fit] = contract.decode(value)
        assert fit == contract_records.CollectiveFit(
            **{k: v for k, v in _fit().items() if k not in ("kind", "where")},
            where=contract_records.Where("cpu", "gloo"),
        )
        return
    with pytest.raises(contract_records.ContractError) as e:
        contract.decode(value)
    assert message in str(e.value)


def test_write_summary_encodes_records_and_refuses_what_a_reader_would_refuse(tmp_path):
    m = contract.read(
        json.loads((FIXTURES / "cpu/fsdp-scaling/20250301-100100-000001/summary.json").read_text())
    )
    write_summary(tmp_path, {"status": "complete", "guide_inputs": m})
    back = json.loads((tmp_path / "summary.json").read_text())
    assert (
        contract.read(back) == m
        and back["guide_inputs"]["schema_version"] == contract.SCHEMA_VERSION
    )
    with pytest.raises(contract_records.ContractError, match="dict is not a guide-input record"):
        write_summary(tmp_path / "x", {"guide_inputs": [{"kind": "training"}]})
    assert not (tmp_path / "x").exists()
    with pytest.raises(contract_records.ContractError, match="model is not a GPTConfig"):
        contract_records.TrainingMeasurement(
            model={"d_model": 10, "n_head": 3},
            layout=m[0].layout,
            strategy="zero3",
            precision="fp32",
            step_time_s=1.0,
            tokens_per_s=1.0,
            peak_mem_bytes=1,
            where=m[0].where,
        )
