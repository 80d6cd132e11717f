"""The layout search as a product of named axes (issue 38): the same candidates in the same order.

``layout_enumeration._enumerate`` was nine nested loops; it is now a tuple of ``Axis`` and one of
``Filter``. The frozen values below were computed with the nested-loop code (this repository
before the rewrite): the count and a SHA-256 of the whole sequence of (layout, rejection) it
yielded. Any change of the set OR the order of the candidates changes the hash, and the plans
(ties are ranked in enumeration order) could change with it.
"""

from __future__ import annotations

import hashlib

import pytest

from dtrain.costmodel import layout_enumeration
from dtrain.costmodel.layout_enumeration import _checks_per_axis, _enumerate
from dtrain.costmodel.layout_space import AXES, FILTERS, LAYOUT_FIELDS, Axis, Filter
from dtrain.costmodel.search import MICRO_BATCHES
from dtrain.core.layout import RECOMPUTE
from dtrain.costmodel.shapes import ModelShape
from dtrain.costmodel.software import SOFTWARE


# Every field a layout is told apart by (ep, etp: always 1 until expert parallelism exists)
KEY_FIELDS = (
    "dp_replicate",
    "dp_shard",
    "cp",
    "tp",
    "pp",
    "zero_stage",
    "recompute",
    "micro_batch",
    "grad_accum",
    "sequence_parallel",
    "pp_schedule",
    "pp_virtual",
    "cp_impl",
    "pp_split",
)

LONG = ModelShape(
    n_layer=32,
    d_model=4096,
    n_head=32,
    n_kv_head=8,
    vocab=128256,
    seq_len=131072,
    ffn_mult=3.5,
    gated_mlp=True,
)
NO_SELECTIVE = tuple(r for r in RECOMPUTE if r != "selective")

# name: (model, GPUs, node size, global batch, micro-batches, recompute, prune, fixed,
#        context parallel, software)
CASES = {
    "70B on 512": (
        ModelShape.from_params(70e9),
        512,
        8,
        1024,
        MICRO_BATCHES,
        NO_SELECTIVE,
        False,
        {},
        True,
        "any",
    ),
    "70B on 512, pruned": (
        ModelShape.from_params(70e9),
        512,
        8,
        1024,
        MICRO_BATCHES,
        NO_SELECTIVE,
        True,
        {},
        True,
        "any",
    ),
    "8B 128K on 64": (LONG, 64, 8, 1024, MICRO_BATCHES, NO_SELECTIVE, False, {}, True, "any"),
    "70B 8K on 256, torchtitan": (
        ModelShape.from_params(70e9, 8192),
        256,
        8,
        1024,
        MICRO_BATCHES,
        ("none", "op", "full"),
        False,
        {},
        True,
        "torchtitan",
    ),
    "13B on 96, megatron-core, eager": (
        ModelShape.from_params(13e9, 32768),
        96,
        8,
        96,
        MICRO_BATCHES,
        RECOMPUTE,
        False,
        {},
        False,
        "megatron-core",
    ),
    "175B on 384, megatron-2021": (
        ModelShape.from_params(175e9),
        384,
        8,
        1536,
        MICRO_BATCHES,
        ("none", "full"),
        False,
        {},
        True,
        "megatron-2021",
    ),
    "8B 128K on 64, dtrain": (
        LONG,
        64,
        8,
        256,
        MICRO_BATCHES,
        ("none", "op", "full"),
        True,
        {},
        True,
        "dtrain",
    ),
    "70B on 512, megatron-deepspeed": (
        ModelShape.from_params(70e9),
        512,
        8,
        1000,
        MICRO_BATCHES,
        ("none", "full"),
        False,
        {},
        True,
        "megatron-deepspeed",
    ),
    "pinned hsdp zbv": (
        ModelShape.from_params(70e9),
        256,
        8,
        512,
        MICRO_BATCHES,
        NO_SELECTIVE,
        False,
        {"dp_replicate": 2, "pp_schedule": "zbv", "virtual_stages": 2},
        True,
        "any",
    ),
    "pinned torch cp": (
        LONG,
        64,
        8,
        64,
        MICRO_BATCHES,
        NO_SELECTIVE,
        False,
        {"cp": 4, "cp_impl": "torch", "zero_stage": 3},
        True,
        "any",
    ),
    "pinned tp pp dp": (
        ModelShape.from_params(405e9),
        1024,
        8,
        512,
        MICRO_BATCHES,
        NO_SELECTIVE,
        True,
        {"tp": 8, "pp": 16, "dp": 8, "pp_split": "balanced"},
        True,
        "any",
    ),
    "pinned sp recompute mb gpipe": (
        ModelShape.from_params(70e9),
        512,
        8,
        1024,
        MICRO_BATCHES,
        NO_SELECTIVE,
        False,
        {
            "sequence_parallel": False,
            "recompute": "full",
            "micro_batch": 2,
            "pp_schedule": "gpipe",
            "zero_stage": 1,
        },
        True,
        "megatron-core",
    ),
    "pinned cp the sequence refuses": (
        LONG,
        64,
        8,
        64,
        MICRO_BATCHES,
        NO_SELECTIVE,
        False,
        {"cp": 3},
        True,
        "any",
    ),
}


def sequence_digest(items) -> tuple[int, str]:
    """(count, SHA-256) of an enumeration: every layout's KEY_FIELDS and its rejection, in order."""
    h, count = hashlib.sha256(), 0
    for lay, why in items:
        row = tuple(getattr(lay, k) for k in KEY_FIELDS) + (str(why) if why else "",)
        h.update(repr(row).encode() + b"\n")
        count += 1
    return count, h.hexdigest()


def enumerate_case(name: str):
    model, gpus, node, batch, mbs, rc, prune, fixed, cp, sw = CASES[name]
    return _enumerate(model, gpus, node, batch, mbs, rc, prune, dict(fixed), cp, SOFTWARE[sw])


# Computed with the nine-loop _enumerate (the code before the rewrite), printed by
# `python tests/test_search_axes.py`.
FROZEN = {
    "70B on 512": (8638, "ace601a38f44eb5800f70a2980c16897264491762a425aca2aa372a385641195"),
    "70B on 512, pruned": (
        3508,
        "5311f93d4624f7675f9d6688632ca2115029a2894db989ab6367463fcaeeb56e",
    ),
    "8B 128K on 64": (33480, "fd225cc9ac60a7f39a425b223906c15b1cb0084547d15b378def0323f09123c7"),
    "70B 8K on 256, torchtitan": (
        4271,
        "72b762dd8d98d35f855bc36aa91d6d2e00af3329c96a7d828b8860360e27f8a5",
    ),
    "13B on 96, megatron-core, eager": (
        2176,
        "8657a4541158322331c64a02c20d11e3b08baf38efc6d5e05d2d2c5a7abcd7e1",
    ),
    "175B on 384, megatron-2021": (
        1436,
        "dcb7506ed697dc50d7f124b0289532e93e563bdb4a5626b785e87c026e8325ba",
    ),
    "8B 128K on 64, dtrain": (
        2525,
        "df8bf2a03e4f6c7182b44a757938cf3719b1602572fdaec2fa7b16912d927e38",
    ),
    "70B on 512, megatron-deepspeed": (
        192,
        "de25913f448b03c62149578b6f73997aff8684749ed51113397dfbd7cacf478a",
    ),
    "pinned hsdp zbv": (958, "b2ca3720ef324b16ae633a7eb13161cb1e2b610c336a39c98837215186c3e820"),
    "pinned torch cp": (907, "e5c8fea0fded65dc42d9b5171cec40230de83ebc24c00ab01c0740ced35edcda"),
    "pinned tp pp dp": (126, "1b33bff5baea7f377b96ad213c37a16a1ec9d1922d97faad4dccde13b816abf6"),
    "pinned sp recompute mb gpipe": (
        37,
        "25ee87ba4742b0edb45387d73cd8bf4d431e9c05ea8b89cb080d1c40f7a87757",
    ),
    "pinned cp the sequence refuses": (
        0,
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_candidates_in_the_same_order(name):
    assert sequence_digest(enumerate_case(name)) == FROZEN[name]


def test_a_pinned_field_is_an_axis():
    """``fixed`` (dtrain plan --layout) pins LAYOUT_FIELDS: each is an axis, checked there."""
    names = [a.name for a in AXES]
    assert set(LAYOUT_FIELDS) <= set(names) and len(names) == len(set(names))
    assert all(f.after in names for f in FILTERS)


def test_a_filter_naming_no_axis_is_refused():
    lost = FILTERS + (Filter("experts split", "ep", lambda s, c: True),)
    with pytest.raises(ValueError) as e:
        _checks_per_axis(AXES, lost)
    assert str(e.value) == f"filters ['experts split'] name no axis of {[a.name for a in AXES]}"


def test_no_axis_is_expanded_under_a_rejected_choice(monkeypatch):
    """Pruning is early: an axis' values are only asked for a choice that passed every filter of
    the axes above it, so a rule on the degrees never expands micro-batches, schedules, ..."""
    asked = {a.name: 0 for a in AXES}

    def watched(i, axis):
        def values(space, chosen):
            asked[axis.name] += 1
            for above in AXES[:i]:
                for f in FILTERS:
                    if f.after == above.name:
                        assert f.ok(space, chosen), (axis.name, f.name, dict(chosen))
            return axis.values(space, chosen)

        return Axis(axis.name, values)

    monkeypatch.setattr(
        layout_enumeration, "AXES", tuple(watched(i, a) for i, a in enumerate(AXES))
    )
    for name in ("70B on 512", "8B 128K on 64, dtrain", "13B on 96, megatron-core, eager"):
        assert sequence_digest(enumerate_case(name)) == FROZEN[name]
    assert asked["tp"] == 3 and asked["sequence_parallel"] > 0


def test_step_time_is_a_plain_class():
    """StepTime was an lru_cache wrapper (a decorator left behind when group_link moved out), so
    isinstance failed; the cache of step times is step_model's."""
    from dtrain.costmodel.hardware import Cluster
    from dtrain.costmodel.shapes import Layout
    from dtrain.costmodel.step_breakdown import StepTime
    from dtrain.costmodel.timemodel import step_model, step_time

    shape, cluster = ModelShape.from_params(7e9), Cluster.from_profile("h100-sxm", 8)
    t = step_time(shape, Layout(dp_shard=8, zero_stage=3), cluster)
    assert isinstance(StepTime, type) and isinstance(t, StepTime) and t.total > 0
    assert step_model.cache_info().currsize >= 1


if __name__ == "__main__":
    for case in CASES:
        count, digest = sequence_digest(enumerate_case(case))
        print(f'    "{case}":\n        ({count}, "{digest}"),')
