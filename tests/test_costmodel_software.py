"""``Stack.software``: the layouts a framework runs (costmodel/software.py). The search returns
only those, the published layout of every backtest row is one its own software runs, "any" is the
search as before, and ``dtrain plan --software`` refuses a pinned field the framework lacks with
a one-line error."""

import json

import pytest

from dtrain.cli.main import main
from dtrain.costmodel import Cluster, ModelShape, search
from dtrain.costmodel.backtest import backtest
from dtrain.costmodel.layout_enumeration import layout_fields
from dtrain.costmodel.published_runs import load_rows, row_setup
from dtrain.costmodel.software import SOFTWARE, unsupported
from dtrain.costmodel.stack import Stack

# a 7B-class model on 64 H100 at 32K tokens: TP, PP, CP, every ZeRO stage and recompute level fit
# somewhere
SHAPE = ModelShape(32, 4096, 32, 8, 128256, 32768, 14336 / 4096, True)
CLUSTER = Cluster.from_profile("h100-sxm", 64, 8)


@pytest.fixture(scope="module")
def searches():
    return {name: search(SHAPE, CLUSTER, 64, stack=Stack(software=name)) for name in SOFTWARE}


@pytest.mark.parametrize("name", [n for n in SOFTWARE if n != "any"])
def test_search_returns_only_what_the_software_runs(searches, name):
    res, sw = searches[name], SOFTWARE[name]
    assert res.ranked, res.reason
    for p in res.ranked:
        assert unsupported(sw, layout_fields(p), SHAPE.n_layer, SHAPE.n_kv_head) is None, (
            name,
            p.describe(),
        )
        assert p.dp * p.cp == 1 or p.zero_stage in sw.zeros(p.pp)
        assert p.cp == 1 or p.cp_impl in sw.cp_impls
        assert p.tp == 1 or p.sequence_parallel in sw.sp
        assert p.recompute in sw.recompute and (p.virtual_stages == 1 or sw.interleaved)
    # the restricted best is one of the unrestricted layouts, never faster than the unrestricted
    # best
    assert res.best.time.tokens_per_s <= searches["any"].best.time.tokens_per_s * (1 + 1e-12)


def test_each_restriction_bites(searches):
    """Each framework's search leaves out a layout kind the unrestricted one ranks."""
    ranked = {n: searches[n].ranked for n in SOFTWARE}
    assert any(p.zero_stage == 1 for p in ranked["any"]) and not any(
        p.zero_stage == 1 for p in ranked["torchtitan"]
    )
    assert any(p.cp_impl == "ulysses" for p in ranked["any"]) and not any(
        p.cp > 1 for p in ranked["megatron-2021"]
    )
    assert all(p.cp_impl == "torch" for p in ranked["torchtitan"] if p.cp > 1)
    assert any(
        p.cp_impl == "torch" for p in ranked["torchtitan"]
    )  # searched there, not only scored
    assert not any(p.virtual_stages > 1 for p in ranked["megatron-deepspeed"])
    assert not any(p.zero_stage >= 2 and p.pp > 1 for p in ranked["megatron-deepspeed"])
    assert not any(p.sequence_parallel for p in ranked["megatron-2021"])
    assert not any(p.tp > 1 and not p.sequence_parallel for p in ranked["torchtitan"])
    assert any(p.cp > 1 and p.pp > 1 for p in ranked["any"])
    assert not any(p.cp > 1 and p.pp > 1 for p in ranked["dtrain"])
    assert not any(p.zero_stage == 2 and p.pp > 1 for p in ranked["dtrain"]) and any(
        p.cp > 1 for p in ranked["dtrain"]
    )
    # 8 KV heads: tp=16 replicates them (dtrain, any); Megatron and torchtitan shard whole KV heads
    assert any(p.tp == 16 for p in ranked["dtrain"]) and any(p.tp == 16 for p in ranked["any"])
    assert not any(
        p.tp > 8 for n in ("torchtitan", "megatron-core", "megatron-2021") for p in ranked[n]
    )


def test_2021_megatron_splits_the_layers_evenly():
    """30 layers on 64 GPUs: the unrestricted search ranks pipelines of uneven stages or chunks
    (pp=4, pp=8, v=4 ...), 2021's Megatron only those whose pp·v divides the 30 layers."""
    shape = ModelShape(30, 8192, 64, 8, 32000, 4096, 3.5, True)
    ranked = {
        n: search(shape, CLUSTER, 256, stack=Stack(software=n)).ranked
        for n in ("any", "megatron-2021")
    }
    assert any(30 % (p.pp * p.virtual_stages) for p in ranked["any"])
    assert ranked["megatron-2021"] and not any(
        30 % (p.pp * p.virtual_stages) for p in ranked["megatron-2021"]
    )
    assert any(p.pp > 1 for p in ranked["megatron-2021"])


def test_megatron_core_interleaves_only_whole_equal_chunks():
    """40 layers on 64 GPUs: Megatron-core runs uneven stages without interleaving (pp=16, pp=32)
    but its interleaved schedule only where pp·v divides the layers (pp=4 v=2 ranks; pp=4 v=4,
    pp=8 v=2 do not, though the unrestricted search ranks them)."""
    shape = ModelShape(40, 8192, 64, 8, 32000, 4096, 3.5, True)
    chunks = {
        n: {
            (p.pp, p.virtual_stages)
            for p in search(shape, CLUSTER, 256, stack=Stack(software=n)).ranked
        }
        for n in ("megatron-core", "any")
    }
    assert {(16, 1), (32, 1), (4, 2)} <= chunks["megatron-core"] and {(4, 4), (8, 2)} <= chunks[
        "any"
    ]
    assert not any(40 % (pp * v) for pp, v in chunks["megatron-core"] if v > 1)


def test_megatron_interleaves_a_multiple_of_pp_micro_batches():
    """Megatron's interleaved schedule runs the micro-batches in groups of pp (schedules.py):
    with 40 layers on pp=4 (dp=2, tp=8) a global batch of 10 leaves 5 micro-batches, enough for
    torch's schedule (>= pp) but not a multiple of 4: Megatron-core scores it only without
    interleaving, and a pinned v=2 says why."""
    shape = ModelShape(40, 8192, 64, 8, 32000, 4096, 3.5, True)
    pinned = {"tp": 8, "pp": 4, "micro_batch": 1}
    by = {
        n: search(shape, CLUSTER, 10, stack=Stack(software=n), fixed=pinned)
        for n in ("megatron-core", "any")
    }
    assert {p.virtual_stages for p in by["any"].ranked} > {1}
    assert {p.virtual_stages for p in by["megatron-core"].ranked} == {1}
    none = search(
        shape,
        CLUSTER,
        10,
        stack=Stack(software="megatron-core"),
        fixed={**pinned, "virtual_stages": 2},
    )
    assert none.best is None and "(a multiple of pp under megatron-core)" in none.reason


def test_any_is_the_unrestricted_search(searches):
    default = search(SHAPE, CLUSTER, 64)
    assert [p.describe() for p in default.ranked] == [p.describe() for p in searches["any"].ranked]


def test_every_published_layout_runs_on_its_own_software():
    rows = load_rows()
    named = [r for r in rows if (r.get("stack") or {}).get("software")]
    assert len(named) >= 50  # all but Meta's internal stack (Llama 3 405B)
    for row in rows:
        s = row_setup(row)
        assert (
            unsupported(s.stack.runs, layout_fields(s.layout), s.shape.n_layer, s.shape.n_kv_head)
            is None
        ), row["name"]
    by_name = {
        r.name: r.software for r in backtest(loo=False, rank=False)
    }  # what --json reports per row
    assert by_name == {r["name"]: (r.get("stack") or {}).get("software", "any") for r in rows}


def test_unsupported_names_the_field_by_hand():
    tt, ds, m21 = SOFTWARE["torchtitan"], SOFTWARE["megatron-deepspeed"], SOFTWARE["megatron-2021"]
    assert unsupported(tt, {"zero_stage": 1}) == "zero=1 (it runs zero=0, 2, 3)"
    assert (
        unsupported(tt, {"cp": 4, "cp_impl": "ulysses"})
        == "cp_impl=ulysses (it runs cp_impl=torch)"
    )
    assert unsupported(ds, {"pp": 4, "zero_stage": 3}) == "zero=3 with pp > 1 (it runs zero=0, 1)"
    assert (
        unsupported(ds, {"pp": 1, "zero_stage": 3}) is None
    )  # DeepSpeed without its pipeline engine
    assert unsupported(ds, {"virtual_stages": 2}) == "v=2 (it has no interleaved schedule)"
    assert (
        unsupported(m21, {"recompute": "selective"}) == "recompute=selective (it runs none, full)"
    )
    assert unsupported(m21, {"tp": 8, "sequence_parallel": True}) == "sp=on with tp > 1"
    assert unsupported(m21, {"cp": 2}) == "cp > 1 (it has no context parallelism)"
    assert (
        unsupported(SOFTWARE["dtrain"], {"cp": 2, "pp": 4})
        == "cp > 1 with pp > 1 (it runs one or the other)"
    )
    # 2021's Megatron builds whole, equal chunks: 105 layers on pp=35 run v=1 or 3, not 2; 30 layers
    # not on pp=4
    assert unsupported(m21, {"pp": 35, "virtual_stages": 2}, 105) == (
        "pp=35 v=2 for 105 layers (it splits the layers into whole, equal chunks: pp·v must "
        "divide them)"
    )
    assert unsupported(m21, {"pp": 35, "virtual_stages": 3}, 105) is None
    assert unsupported(m21, {"pp": 4}, 30) == (
        "pp=4 for 30 layers (it splits the layers into whole, equal chunks: pp·v must divide them)"
    )
    assert unsupported(SOFTWARE["megatron-core"], {"pp": 4}, 30) is None  # uneven first/last stages
    # ... but its interleaved schedule builds whole, equal chunks (arguments.py): 80 layers on pp=8
    # run v=2, not v=4
    assert unsupported(SOFTWARE["megatron-core"], {"pp": 8, "virtual_stages": 4}, 80) == (
        "pp=8 v=4 for 80 layers (its interleaved schedule splits the layers into whole, equal "
        "chunks: pp·v must divide them)"
    )
    assert unsupported(SOFTWARE["megatron-core"], {"pp": 8, "virtual_stages": 2}, 80) is None
    # Megatron and torchtitan shard whole KV heads; dtrain replicates them above tp
    assert (
        unsupported(tt, {"tp": 16}, 32, 8)
        == "tp=16 with 8 KV heads (it shards whole KV heads: tp must divide them)"
    )
    assert unsupported(SOFTWARE["megatron-core"], {"tp": 8}, 32, 8) is None
    assert unsupported(SOFTWARE["dtrain"], {"tp": 16}, 32, 8) is None
    assert unsupported(SOFTWARE["dtrain"], {"cp": 2, "cp_impl": "ulysses", "pp": 1}) is None
    assert (
        unsupported(SOFTWARE["megatron-core"], {"dp_replicate": 4, "zero_stage": 1})
        == "hsdp=4 (it has no hybrid sharding)"
    )
    assert unsupported(tt, {"dp_replicate": 4, "zero_stage": 3}) is None
    assert unsupported(SOFTWARE["any"], {"zero_stage": 1, "cp_impl": "torch", "cp": 2}) is None
    with pytest.raises(ValueError, match="software='nemo' must be one of any, megatron-core, "):
        Stack(software="nemo")


def _plan(capsys, *extra):
    rc = main(
        [
            "plan",
            "--params",
            "8e9",
            "--gpus",
            "64",
            "--seq",
            "8192",
            "--global-batch",
            "256",
            *extra,
        ]
    )
    return rc, capsys.readouterr()


def test_plan_flag_and_its_error(capsys):
    rc, out = _plan(
        capsys, "--software", "torchtitan", "--layout", "tp=1 zero=3 recompute=full", "--json"
    )
    assert rc == 0
    d = json.loads(out.out)
    assert d["software"] == "torchtitan" and d["choice"]["zero_stage"] != 1
    assert d["layout"]["slower_than_best_pct"] >= 0
    rc, out = _plan(capsys, "--software", "torchtitan", "--layout", "tp=1 zero=3 recompute=full")
    assert rc == 0 and "slower than the best layout torchtitan runs" in out.out
    rc, out = _plan(capsys, "--software", "torchtitan", "--layout", "zero=1")
    assert rc == 2 and out.out == ""
    assert out.err.strip() == (
        "error: --layout: torchtitan does not run zero=1 (it runs zero=0, 2, 3): change "
        "--layout, or pass the --software that runs it (--software any scores every layout)"
    )
    rc, out = _plan(capsys, "--software", "megatron-deepspeed", "--layout", "pp=4 v=2")
    assert (
        rc == 2
        and "megatron-deepspeed does not run v=2 (it has no interleaved schedule)" in out.err
    )
    # an interpolated ~11B has 34 layers: pp=2 splits them evenly, pp=4 does not (8B's 32 both)
    layers = ModelShape.from_params(11e9).n_layer
    rc, out = _plan(capsys, "--software", "megatron-2021", "--layout", "pp=2", "--params", "11e9")
    assert layers == 34 and rc == 0 and out.err == ""
    rc, out = _plan(capsys, "--software", "megatron-2021", "--layout", "pp=4", "--params", "11e9")
    assert (
        rc == 2 and "megatron-2021 does not run pp=4 for 34 layers (it splits the layers" in out.err
    )
    rc, out = _plan(capsys, "--software", "megatron-deepspeed", "--layout", "pp=1 zero=3 hsdp=4")
    assert (
        rc == 2 and "megatron-deepspeed does not run hsdp=4 (it has no hybrid sharding)" in out.err
    )
    assert main(["plan", "--params", "8e9", "--gpus", "8", "--software", "nemo"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: dtrain plan: argument --software: invalid choice: 'nemo'")
        and err.count("\n") == 1
    )


def test_dtrain_software_choices_run_on_the_trainer_as_priced():
    """Every layout the search returns for --software dtrain maps to trainer overrides with no
    note of a feature the trainer lacks or runs otherwise than priced (only the model's own
    vocabulary / MLP notes remain)."""
    from dtrain.costmodel.overrides import train_overrides

    res = search(SHAPE, CLUSTER, 64, stack=Stack(software="dtrain"))
    assert res.ranked
    for p in res.ranked:
        _, notes = train_overrides(p, SHAPE, 64)
        assert [n for n in notes if not n.startswith(("vocabulary", "the trainer's GPT"))] == [], (
            p.describe()
        )


def test_plan_says_what_the_framework_costs(capsys):
    """--software X also searches every layout and says how much faster the unrestricted best is
    (JSON and text); the gap is the two searches' tokens/s ratio, and never negative."""
    rc, out = _plan(capsys, "--software", "megatron-2021", "--json", "--top", "0")
    d = json.loads(out.out)
    restricted, free = d["choice"], d["any_framework"]["choice"]
    assert rc == 0 and not restricted["sequence_parallel"] and restricted["zero_stage"] == 0
    assert d["any_framework"]["faster_pct"] == pytest.approx(
        100 * (free["tokens_per_s"] / restricted["tokens_per_s"] - 1), rel=1e-9
    )
    assert (
        d["any_framework"]["faster_pct"] > 0.05
    )  # 2021's Megatron lacks what the best layout uses
    rc, out = _plan(capsys, "--software", "megatron-2021", "--top", "0")
    lines = out.out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("framework:"))
    more = [x for x in lines[at + 1 :]]
    more = more[: next((i for i, x in enumerate(more) if not x.startswith(" ")), len(more))]
    line = " ".join([lines[at], *(x.strip() for x in more)])  # wrapped within 100 columns
    assert f"is {d['any_framework']['faster_pct']:.1f}% faster than megatron-2021's best" in line
    rc, out = _plan(capsys, "--json", "--top", "0")
    assert "any_framework" not in json.loads(
        out.out
    )  # --software any: one search, nothing to compare


def test_fsdp2_zero3_gathers_the_root_once_a_micro_batch():
    """FSDP2 keeps its root unit (embeddings, output projection) gathered from forward to
    backward: under ZeRO-3 each micro-batch gathers the blocks twice and the root once (the CPU
    count: dtrain.gpucheck.fsdp_copy_out). Under PP a stage gathers once a step either way."""
    from dataclasses import replace

    from dtrain.costmodel import Layout, step_time
    from dtrain.costmodel.collectives import all_gather_time, group_link
    from dtrain.costmodel.comm_time import dp_comm_time, root_gathers_saved
    from dtrain.costmodel.model_states import embedding_params_per_gpu, params_per_gpu

    shape = ModelShape(16, 2048, 32, 8, 128256, 4096, 8192 / 2048, True, tied_embeddings=True)
    cluster = Cluster.from_profile("h100-sxm", 8, 8)
    lay = Layout(dp_shard=8, zero_stage=3, recompute="none", micro_batch=1, grad_accum=4)
    psi, root = params_per_gpu(shape, 1, 1), embedding_params_per_gpu(shape, 1, 1)
    link = group_link(cluster, 8, 1, multi_rail=True)
    ag_all, ag_blocks = (
        all_gather_time(2 * psi, 8, link),
        all_gather_time(2 * (psi - root), 8, link),
    )
    grads, plain = dp_comm_time(shape, lay, cluster, 2)
    assert dp_comm_time(shape, lay, cluster, 2, root_once=True) == pytest.approx(
        (grads, plain - 4 * (ag_all - ag_blocks)), rel=1e-12
    )  # 8 gathers of the whole model less 4 of the root's bytes
    assert root / psi > 0.2  # a small model's root is a fifth of it: the traffic it saves
    assert [root_gathers_saved(x, True) for x in (lay, replace(lay, pp=2, dp_shard=4))] == [4, 0]
    assert root_gathers_saved(lay, False) == 0  # FSDP1, DeepSpeed: not priced apart
    t_fsdp2 = step_time(shape, lay, cluster, stack=Stack(software="torchtitan"))
    t_any = step_time(shape, lay, cluster)
    assert t_any.dp_comm - t_fsdp2.dp_comm == pytest.approx(4 * (ag_all - ag_blocks), rel=1e-9)


def test_fsdp2_zero2_gathers_the_weights_for_every_micro_batch():
    """torchtitan's and dtrain's ZeRO-2 is FSDP2 without resharding after forward: it reshards
    after each backward, so the weights are gathered m times a step (DeepSpeed's ZeRO-2, "any":
    once); the gradients m times either way."""
    from dtrain.costmodel import Layout, step_time
    from dtrain.costmodel.collectives import all_gather_time, group_link, reduce_scatter_time
    from dtrain.costmodel.comm_time import dp_comm_time
    from dtrain.costmodel.model_states import params_per_gpu

    shape, cluster = (
        ModelShape(32, 4096, 32, 8, 128256, 4096, 14336 / 4096, True),
        Cluster.from_profile("h100-sxm", 64, 8),
    )
    lay = Layout(dp_shard=64, zero_stage=2, recompute="none", micro_batch=1, grad_accum=4)
    psi = params_per_gpu(shape, 1, 1)
    link = group_link(cluster, 64, 1, multi_rail=True)
    ag, rs = all_gather_time(2 * psi, 64, link), reduce_scatter_time(4 * psi, 64, link)
    assert dp_comm_time(shape, lay, cluster, 2) == pytest.approx((4 * rs, ag), rel=1e-12)
    assert dp_comm_time(shape, lay, cluster, 2, zero2_regathers=True) == pytest.approx(
        (4 * rs, 4 * ag), rel=1e-12
    )
    t_any = step_time(shape, lay, cluster)
    t_fsdp = step_time(shape, lay, cluster, stack=Stack(software="torchtitan"))
    assert t_fsdp.dp_comm - t_any.dp_comm == pytest.approx(3 * ag, rel=1e-9)
    one = Layout(
        dp_shard=64, zero_stage=2, recompute="none", micro_batch=1, grad_accum=1
    )  # one micro-batch a step: the two are the same, but for FSDP2's copy-out of the gather
    fsdp2 = step_time(shape, one, cluster, stack=Stack(software="dtrain"))
    assert fsdp2.fsdp_copy_out > 0
    assert fsdp2.total - fsdp2.fsdp_copy_out == pytest.approx(
        step_time(shape, one, cluster).total, rel=1e-12
    )
