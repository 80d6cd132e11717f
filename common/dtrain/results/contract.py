"""The calibration contract: how the records an experiment publishes for the cost model and the
guide (``dtrain.results.contract_records``) are stored in a run's ``summary.json`` and read back.

Each experiment's ``finalize`` returns ``"guide_inputs": [records]``;
``dtrain.results.metrics.write_summary`` encodes them into ``summary.json`` as

    "guide_inputs": {"schema_version": 2, "records": [{"kind": "<record kind>", ...fields}, ...]}

and ``read(summary)`` turns them back into dataclasses, refusing unknown kinds, unknown or missing
fields and a newer schema with ``ContractError``. Schema 2 stores a training run's layout as the
one layout type, ``dtrain.core.layout.Layout``; a schema-1 record (the trainer's names: dp,
strategy, activation checkpointing) is upgraded on reading by ``_training_v1``, the one place that
knows them. Calibration (``dtrain.costmodel.calibrate``), the local checks
(``dtrain.guide.local_check``) and the GEMM probe read runs only through these records, never an
experiment's name or its config.yaml, so a new experiment that publishes them is calibrated like
the four here.

Runs made from other runs (a study report, an FP8 comparison, the GEMM probe) are written by
``dtrain.results.derived.write_derived_run``, which records the run directories they came from in
``summary["derived_from"]``; they publish only what they derived, never copies of their sources'
records, so every measurement reaches calibration exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from dtrain.core.layout import STRATEGIES, Layout, recompute_of, schedule_of
from dtrain.results.contract_records import RECORDS, ContractError, TrainingMeasurement

SCHEMA_VERSION = 2
KEY = "guide_inputs"
DERIVED_FROM = "derived_from"


@dataclass(frozen=True)
class _TrainLayoutV1:
    """Schema 1's layout of a training record, in the trainer's names: read only, to upgrade it
    (``_training_v1``); schema 2 records a ``dtrain.core.layout.Layout``."""

    world_size: int
    dp: int
    tp: int
    pp: int
    strategy: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    recompute: str = "none"  # train.activation_checkpointing: none | op | block
    sequence_parallel: bool = False
    pp_schedule: str | None = None  # train.pp_schedule (None without a pipeline)
    pp_virtual: int = 1
    cp: int = 1  # 1 in records written before context parallelism


# ---------------------------------------------------------------- encoding


def encode(records) -> dict:
    """The summary.json value for ``records`` (what ``write_summary`` stores under ``KEY``)."""
    out = []
    for r in records:
        if type(r) not in RECORDS.values():
            raise ContractError(
                f"{type(r).__name__} is not a guide-input record ({', '.join(RECORDS)})"
            )
        out.append({"kind": r.kind, **dataclasses.asdict(r)})
    return {"schema_version": SCHEMA_VERSION, "records": out}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_scalar(value, hint, where: str):
    if value is None:
        if type(None) not in typing.get_args(hint):
            raise ContractError(f"{where} is null but must be {getattr(hint, '__name__', hint)}")
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = (
        args[0]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
        else hint
    )
    if dataclasses.is_dataclass(base):
        return _build(base, value, where)
    origin = typing.get_origin(base)
    if origin is list:
        (item,) = typing.get_args(base)
        if not isinstance(value, list):
            raise ContractError(f"{where} must be a list")
        return [_check_scalar(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if base is float:
        if not _is_number(value) or not math.isfinite(value):
            raise ContractError(f"{where}={value!r} must be a finite number")
        return float(value)
    if base is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ContractError(f"{where}={value!r} must be an integer")
        return value
    if base in (str, bool, dict) and not isinstance(value, base):
        raise ContractError(f"{where}={value!r} must be a {base.__name__}")
    return value


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ContractError(f"{where} must be a JSON object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names - {"kind"})
    if unknown:
        raise ContractError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ContractError(f"{where}: missing field {f.name}")
            continue
        kwargs[f.name] = _check_scalar(data[f.name], hints[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except ContractError:
        raise
    except ValueError as e:  # a record's own rules (a Layout's degrees, its vocabularies)
        raise ContractError(f"{where}: {e}") from None


def _training_v1(rec: dict, where: str) -> dict:
    """A schema-1 training record as schema 2 writes it: its layout in the trainer's names
    (``_TrainLayoutV1``) becomes a ``dtrain.core.layout.Layout``, its strategy a field of the
    record. Schema 1 kept no ``hsdp_replicate``: an hsdp run becomes ZeRO-3 over all its data shards
    (as
    it was priced then); activation checkpointing ``block`` becomes recompute ``full``."""
    old = _build(_TrainLayoutV1, rec.get("layout"), f"{where}.layout")
    if old.strategy not in STRATEGIES:
        raise ContractError(
            f"{where}.layout.strategy={old.strategy!r} must be one of {', '.join(STRATEGIES)}"
        )
    if old.dp * old.cp * old.tp * old.pp != old.world_size:
        raise ContractError(
            f"{where}.layout: world_size={old.world_size} is not dp x cp x tp x pp "
            f"= {old.dp} x {old.cp} x {old.tp} x {old.pp}"
        )
    model = rec.get("model")
    if isinstance(model, dict) and model.get("seq_len") != old.seq_len:
        raise ContractError(
            f"{where}.layout.seq_len={old.seq_len} is not the model's "
            f"seq_len={model.get('seq_len')!r}"
        )
    piped = old.pp > 1
    schedule = old.pp_schedule if piped and old.pp_schedule else "1f1b"
    try:
        layout = Layout.from_strategy(
            old.strategy,
            dp=old.dp,
            cp=old.cp,
            tp=old.tp,
            pp=old.pp,
            recompute=recompute_of(old.recompute, default="none"),
            micro_batch=old.micro_batch,
            grad_accum=old.grad_accum,
            sequence_parallel=old.sequence_parallel and old.tp > 1,
            pp_schedule=schedule_of(schedule),
            pp_virtual=old.pp_virtual if piped else 1,
        )
    except KeyError:
        raise ContractError(
            f"{where}.layout.pp_schedule={old.pp_schedule!r} is not a schedule of the trainer"
        ) from None
    except ValueError as e:
        raise ContractError(f"{where}.layout: {e}") from None
    return {**rec, "layout": dataclasses.asdict(layout), "strategy": old.strategy}


def decode(value) -> list:
    """Records from a summary's ``KEY`` value; ContractError says what is wrong."""
    if not isinstance(value, dict) or not isinstance(value.get("records"), list):
        raise ContractError(f"{KEY} must be {{'schema_version': int, 'records': [...]}}")
    version = value.get("schema_version")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ContractError(
            f"{KEY}.schema_version={version!r}: this dtrain reads schema 1..{SCHEMA_VERSION}"
        )
    out = []
    for i, rec in enumerate(value["records"]):
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind not in RECORDS:
            raise ContractError(
                f"{KEY}.records[{i}]: unknown kind {kind!r} (known: {', '.join(RECORDS)})"
            )
        where = f"{KEY}.records[{i}] ({kind})"
        if version == 1 and kind == TrainingMeasurement.kind:
            rec = _training_v1(rec, where)
        out.append(_build(RECORDS[kind], rec, where))
    return out


def read(summary: dict) -> list:
    """The records of one run's summary ([] when it publishes none)."""
    return decode(summary[KEY]) if KEY in summary else []


def derived_from(summary: dict, run_dir) -> list[Path]:
    """The run directories a derived run was made from (stored relative to it), resolved."""
    return [(Path(run_dir) / p).resolve() for p in summary.get(DERIVED_FROM) or []]
