"""A training record carries the one layout type (issue 38): schema 2 stores a
`dtrain.core.layout.Layout`, schema 1 records (the trainer's names) are upgraded on reading, a newer
schema is refused in one line."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from dtrain.core.layout import Layout
from dtrain.results import contract, contract_records
from dtrain.results.metrics import write_summary

FIXTURES = Path(__file__).parent / "fixtures" / "results"
MEASURED = Path(__file__).resolve().parents[1] / "measured"
MODEL = {
    "vocab_size": 256,
    "seq_len": 256,
    "n_layer": 4,
    "n_head": 4,
    "n_kv_head": 4,
    "d_model": 128,
    "mlp_ratio": 4,
}
WHERE = {"device": "cpu", "backend": "gloo", "gpu_name": None}


def _v1(**layout) -> dict:
    """A schema-1 training record as `trainer_inputs.training_inputs` wrote it before schema 2."""
    lay = {
        "world_size": 2,
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "strategy": "zero3",
        "micro_batch": 4,
        "grad_accum": 1,
        "seq_len": 256,
        "recompute": "none",
        "sequence_parallel": False,
        "pp_schedule": None,
        "pp_virtual": 1,
        "cp": 1,
        **layout,
    }
    return {
        "kind": "training",
        "model": dict(MODEL),
        "layout": lay,
        "precision": "fp32",
        "step_time_s": 0.9,
        "tokens_per_s": 2000.0,
        "peak_mem_bytes": 1,
        "where": dict(WHERE),
    }


def _decode(version: int, *records: dict) -> list:
    return contract.decode({"schema_version": version, "records": list(records)})


@pytest.mark.parametrize(
    "v1_layout, strategy, expected",
    [
        ({}, "zero3", Layout(dp_shard=2, zero_stage=3, micro_batch=4)),
        ({"strategy": "ddp"}, "ddp", Layout(dp_replicate=2, micro_batch=4)),
        ({"strategy": "single", "world_size": 1, "dp": 1}, "single", Layout(micro_batch=4)),
        # schema 1 has no hsdp_replicate: ZeRO-3 over every data shard, as the local check priced it
        (
            {"strategy": "hsdp", "world_size": 4, "dp": 4},
            "hsdp",
            Layout(dp_shard=4, zero_stage=3, micro_batch=4),
        ),
        (
            {
                "world_size": 4,
                "dp": 1,
                "tp": 2,
                "pp": 2,
                "pp_schedule": "interleaved_1f1b",
                "pp_virtual": 2,
                "recompute": "block",
                "sequence_parallel": True,
                "grad_accum": 4,
            },
            "zero3",
            Layout(
                tp=2,
                pp=2,
                pp_virtual=2,
                recompute="full",
                sequence_parallel=True,
                micro_batch=4,
                grad_accum=4,
            ),
        ),
        (
            {"world_size": 2, "dp": 1, "pp": 2, "pp_schedule": "gpipe", "grad_accum": 2},
            "zero3",
            Layout(pp=2, pp_schedule="gpipe", micro_batch=4, grad_accum=2),
        ),
        (
            {"world_size": 4, "dp": 2, "cp": 2, "recompute": "op"},
            "zero3",
            Layout(dp_shard=2, cp=2, zero_stage=3, recompute="op", micro_batch=4),
        ),
    ],
)
def test_a_schema_1_record_reads_as_the_layout_it_ran(v1_layout, strategy, expected):
    [m] = _decode(1, _v1(**v1_layout))
    assert m.layout == expected and m.strategy == strategy
    assert m.layout.world_size == _v1(**v1_layout)["layout"]["world_size"]
    assert contract.encode([m])["schema_version"] == 2  # written back as schema 2


def test_a_schema_1_record_written_before_cp_reads_with_cp_1():
    rec = _v1()
    del rec["layout"]["cp"]
    [m] = _decode(1, rec)
    assert m.layout == Layout(dp_shard=2, zero_stage=3, micro_batch=4)


@pytest.mark.parametrize(
    "v1_layout, message",
    [
        (
            {"strategy": "fancy"},
            "records[0] (training).layout.strategy='fancy' must be one of single, "
            "ddp, zero2, zero3, hsdp",
        ),
        (
            {"world_size": 3},
            "records[0] (training).layout: world_size=3 is not dp x cp x tp x pp = 2 x 1 x 1 x 1",
        ),
        (
            {"seq_len": 512},
            "records[0] (training).layout.seq_len=512 is not the model's seq_len=256",
        ),
        (
            {"dp": 1, "world_size": 2, "pp": 2, "pp_schedule": "weird"},
            "records[0] (training).layout.pp_schedule='weird' is not a schedule of the trainer",
        ),
        ({"tp": "2"}, "records[0] (training).layout.tp='2' must be an integer"),
    ],
)
def test_a_bad_schema_1_layout_is_refused_saying_where(v1_layout, message):
    with pytest.raises(contract_records.ContractError) as e:
        _decode(1, _v1(**v1_layout))
    assert str(e.value) == f"guide_inputs.{message}"


def test_the_committed_schema_1_measurements_read_as_layouts():
    """The GPU runs under measured/ were written in schema 1: every training record upgrades."""
    seen = 0
    for path in sorted(MEASURED.rglob("summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("guide_inputs", {}).get("schema_version") != 1:
            continue
        raw = [r for r in summary["guide_inputs"]["records"] if r.get("kind") == "training"]
        records = [
            r for r in contract.read(summary) if isinstance(r, contract_records.TrainingMeasurement)
        ]
        for old, new in zip(raw, records, strict=True):
            assert isinstance(new.layout, Layout) and new.strategy == old["layout"]["strategy"]
            assert (new.layout.world_size, new.layout.dp, new.layout.micro_batch) == (
                old["layout"]["world_size"],
                old["layout"]["dp"],
                old["layout"]["micro_batch"],
            )
            seen += 1
    if seen == 0:
        pytest.skip("no schema-1 training record under measured/ in this checkout")


def test_a_schema_2_record_round_trips_through_summary_json(tmp_path):
    rng = random  # seeded by conftest's seeded_randomness, which prints the seed
    for i in range(20):
        pp = rng.choice([1, 2, 4])
        lay = Layout.from_strategy(
            rng.choice(["ddp", "zero2", "zero3", "hsdp"]),
            dp=4,
            hsdp_replicate=2,
            tp=rng.choice([1, 2]),
            pp=pp,
            cp=rng.choice([1, 2]),
            recompute=rng.choice(["none", "op", "selective", "full"]),
            micro_batch=rng.randint(1, 8),
            grad_accum=rng.randint(1, 8),
            pp_virtual=2 if pp > 1 else 1,
            pp_schedule=rng.choice(["1f1b", "zbv"]) if pp > 1 else "1f1b",
            cp_impl=rng.choice(["ring", "ulysses", "torch"]),
            pp_split=rng.choice(["layers", "balanced"]),
        )
        m = contract_records.TrainingMeasurement(
            model=dict(MODEL),
            layout=lay,
            strategy=lay.strategy,
            precision="bf16",
            step_time_s=1.5,
            tokens_per_s=10.0,
            peak_mem_bytes=7,
            where=contract_records.Where("cpu", "gloo"),
        )
        (tmp_path / str(i)).mkdir()
        write_summary(tmp_path / str(i), {"status": "complete", "guide_inputs": [m]})
        back = json.loads((tmp_path / str(i) / "summary.json").read_text())
        assert back["guide_inputs"]["schema_version"] == 2
        assert back["guide_inputs"]["records"][0]["layout"]["dp_replicate"] == lay.dp_replicate
        assert contract.read(back) == [m], lay


def test_the_fixture_records_are_schema_2_layouts():
    path = FIXTURES / "cpu/fsdp-scaling/20250301-100100-000001/summary.json"
    summary = json.loads(path.read_text())
    assert summary["guide_inputs"]["schema_version"] == 2
    [m] = contract.read(summary)
    assert (m.layout, m.strategy) == (Layout(dp_shard=2, zero_stage=3, micro_batch=4), "zero3")


def test_a_schema_2_layout_the_type_refuses_is_a_contract_error():
    path = FIXTURES / "cpu/fsdp-scaling/20250301-100100-000001/summary.json"
    value = copy.deepcopy(json.loads(path.read_text())["guide_inputs"])
    value["records"][0]["layout"]["ep"] = 4  # dp_shard 2 cannot fold 4 expert ranks
    with pytest.raises(contract_records.ContractError) as e:
        contract.decode(value)
    assert str(e.value).startswith(
        "guide_inputs.records[0] (training).layout: ep·etp = 4 must divide the ranks"
    )


def test_a_newer_schema_is_refused_in_one_line():
    with pytest.raises(contract_records.ContractError) as e:
        _decode(3, _v1())
    assert str(e.value) == "guide_inputs.schema_version=3: this dtrain reads schema 1..2"
    assert "\n" not in str(e.value)


def _hsdp_prediction(tmp_path, layout: Layout) -> float:
    """The local check's predicted step of the fixture's zero3 run recorded as a 4-rank hsdp run."""
    import dataclasses
    import shutil

    from dtrain.costmodel.calibrate import calibrate
    from dtrain.guide.local_check import local_checks

    root = tmp_path / "cpu"
    shutil.copytree(FIXTURES / "cpu", root)
    run = root / "fsdp-scaling/20250301-100100-000001"
    summary = json.loads((run / "summary.json").read_text())
    [m] = contract.read(summary)
    hsdp = dataclasses.replace(m, layout=layout, strategy="hsdp")
    write_summary(run, {**summary, "guide_inputs": [hsdp]})
    checks = local_checks(calibrate([root], warn=False))
    [row] = [c for c in checks if c.run.endswith("100100-000001")]
    assert row.what == "hsdp x4 step"
    return row.predicted_s


def test_the_local_check_prices_hsdp_by_its_replicas_and_shards(tmp_path):
    """Schema 2 keeps dp_replicate: 2 replicas of 2 shards are no longer priced as ZeRO-3 over 4."""
    hsdp = _hsdp_prediction(
        tmp_path / "a", Layout(dp_replicate=2, dp_shard=2, zero_stage=3, micro_batch=4)
    )
    flat = _hsdp_prediction(tmp_path / "b", Layout(dp_shard=4, zero_stage=3, micro_batch=4))
    assert hsdp != pytest.approx(flat, rel=1e-6)
    # a schema-1 hsdp record reads as the flat one (it kept no hsdp_replicate)
    [m] = _decode(1, _v1(strategy="hsdp", world_size=4, dp=4))
    assert m.layout == Layout(dp_shard=4, zero_stage=3, micro_batch=4)
