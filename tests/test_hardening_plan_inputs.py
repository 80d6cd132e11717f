"""`dtrain plan` input checks (issue "hardening, third round", area C2) and the guide's local check
counting copies of one run once: each bad input is one `error:` line, exit 2, naming the rule and
the numbers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TEST_SEED, py
from dtrain.cli.main import main
from dtrain.core.errors import UserError
from dtrain.costmodel import Cluster, ModelShape, layout_enumeration, layout_space, search
from dtrain.costmodel.backtest import backtest
from dtrain.costmodel.backtest_cli import text_lines
from dtrain.costmodel.calibrate import calibrate
from dtrain.costmodel.shapes import params_text
from dtrain.guide.local_check import local_checks
from dtrain.guide.checks_section import checks_table
from dtrain.parallel.feasibility import check_cp_model, check_tp_model

CPU = Path(__file__).parent / "fixtures" / "results" / "cpu"


def refused(*args: str) -> str:
    """The stderr of a `dtrain plan` that must refuse its input: one `error:` line, exit 2, no
    traceback."""
    p = py("-m", "dtrain.cli.main", "plan", *args)
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr)
    err = p.stderr
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert p.stdout == ""  # nothing half-printed before the refusal
    return p.stderr.strip()


def plan_text(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# item 1: the shape's rules, named by the flags that give them


def test_heads_that_do_not_divide_hidden_name_the_rule():
    assert refused("--gpus", "8", "--layers", "3", "--hidden", "100", "--heads", "7") == (
        "error: --hidden 100 is not divisible by --heads 7 (head dim must be a whole number): "
        "pick heads that divide hidden"
    )


def test_kv_heads_that_do_not_divide_heads_name_the_rule():
    shape = ["--layers", "3", "--hidden", "128", "--heads", "8", "--kv-heads", "3"]
    assert refused("--gpus", "8", *shape) == (
        "error: --heads 8 is not divisible by --kv-heads 3 (each k/v head serves a whole group of "
        "query heads): pick kv-heads that divide heads"
    )


def test_model_shape_errors_name_the_rule_not_the_repr():
    with pytest.raises(ValueError, match=r"^d_model=100 is not divisible by n_head=7 \(") as e:
        ModelShape(3, 100, 7, 7, 32000, 4096)
    assert "ModelShape(" not in str(e.value)
    with pytest.raises(ValueError, match=r"^seq_len=0 must be a positive integer$"):
        ModelShape(3, 128, 8, 8, 32000, 0)


# item 2: context parallelism's zigzag split (the trainer's check_cp_model: 2·cp chunks a sequence)


def test_cp_with_a_sequence_it_cannot_split_is_the_trainers_rule():
    assert refused("--gpus", "8", "--params", "7e9", "--layout", "cp=2", "--seq", "4097") == (
        "error: --layout 'cp=2': --seq 4097 is not divisible by 2 x cp = 4 (each rank holds 2 of "
        "2·cp equal chunks): pick --seq a multiple of 4"
    )


# item 3: a global batch no layout's replicas can share


def test_global_batch_1_says_what_helps_not_more_gpus():
    err = refused("--gpus", "64", "--params", "125M", "--global-batch", "1")
    assert err == (
        "error: --global-batch 1 cannot be split over 64 GPUs: every layout of this model has at "
        "least dp=2 data-parallel replicas (tp, cp and pp are bounded by its heads, sequence and "
        "layers) and a global batch of 1 feeds at most 1 data-parallel replica: give a "
        "--global-batch that is a multiple of 2, or fewer --gpus"
    )
    assert "more GPUs" not in err


def test_a_global_batch_that_is_not_a_multiple_of_any_dp():
    assert refused("--gpus", "512", "--params", "125M", "--global-batch", "1000") == (
        "error: --global-batch 1000 cannot be split over 512 GPUs: every layout of this model has "
        "at least dp=16 data-parallel replicas (tp, cp and pp are bounded by its heads, sequence "
        "and layers) and 1000 is not a multiple of any of their dp: give a --global-batch that is "
        "a multiple of 16, or fewer --gpus"
    )


def test_a_model_too_big_still_gets_the_memory_hint(capsys):
    code, _, err = plan_text(capsys, "--params", "405e9", "--gpus", "8", "--global-batch", "1")
    assert code == 1 and "hint: more GPUs" in err


# item 4: inputs that were accepted though wrong


@pytest.mark.parametrize("text", ["", "  "])
def test_an_empty_layout_is_refused(text):
    assert refused("--gpus", "8", "--params", "7e9", "--layout", text) == (
        f'error: --layout {text!r} is empty: give fields like "tp=8 pp=2 zero=1 mb=1" or leave '
        "--layout out"
    )


@pytest.mark.parametrize("params, shown", [("1", "1"), ("20M", "20M"), ("28e6", "28M")])
def test_params_below_the_smallest_buildable_model_is_refused_with_the_minimum(params, shown):
    low = ModelShape.smallest_from_params()
    assert (low.n_layer, low.d_model, low.num_params()) == (1, 512, 28_878_848)
    assert refused("--gpus", "8", "--params", params) == (
        f"error: --params {shown} is below 28.9M, the smallest model --params builds (1 layer x "
        "512, 8 heads, a 50257-token vocabulary): give --params 28.9M or more, or the shape "
        "(--layers --hidden --heads)"
    )


def test_small_models_print_their_size_in_millions(capsys):
    code, out, _ = plan_text(capsys, "--gpus", "8", "--params", "30M")
    assert code == 0
    assert out.splitlines()[0] == (
        "model:    ~30M (interpolated): 1 layers, d_model 512, 8 heads "
        "(8 KV), seq 4096, 28.9M params"
    )
    assert ModelShape.from_params(40e6).name == "~40M (interpolated)"
    sizes = (1, 20e6, 1.24e9, 405e9, 2e12)
    assert [params_text(n) for n in sizes] == ["1", "20M", "1.24B", "405B", "2T"]
    code, out, _ = plan_text(capsys, "--gpus", "8", "--params", "7e9")
    assert code == 0 and ", 6.7B params" in out.splitlines()[0]  # unchanged from 1B up


@pytest.mark.parametrize(
    "shape, layout, rule",
    [
        (
            ["--layers", "4", "--hidden", "1024", "--heads", "16", "--ffn-hidden", "7"],
            "tp=8",
            "tp=8 does not divide the MLP width 7: pick another tp",
        ),
        (
            ["--layers", "4", "--hidden", "768", "--heads", "12"],
            "tp=8",
            "--heads 12 is not divisible by tp=8: pick a tp that divides the head count",
        ),
        (
            ["--layers", "4", "--hidden", "1536", "--heads", "24", "--kv-heads", "3"],
            "tp=8",
            "tp=8 is not a multiple of --kv-heads 3: k/v heads can only be replicated evenly; "
            "pick --kv-heads dividing tp",
        ),
        (
            ["--layers", "4", "--hidden", "1024", "--heads", "16", "--seq", "4098"],
            "tp=4 sp=on",
            "sp=on: --seq 4098 is not divisible by tp=4",
        ),
        (
            ["--params", "7e9", "--seq", "8192"],
            "cp=8 cp_impl=ulysses tp=8",
            "cp_impl=ulysses spreads a rank's 4 query heads (--heads / tp) over cp=8 ranks, which "
            "does not divide them: use cp_impl=ring",
        ),
    ],
)
def test_a_layout_the_trainer_refuses_is_refused_naming_the_rule(shape, layout, rule):
    err = refused("--gpus", "64", *shape, "--layout", layout)
    assert err == f"error: --layout {layout!r}: {rule}"


def test_the_search_skips_a_tp_the_mlp_width_cannot_split():
    shape = ModelShape(4, 1024, 16, 16, 32000, 4096, 7 / 1024)
    res = search(shape, Cluster.from_profile("h100-sxm", 8), 1024)
    assert res.ranked and {p.tp for p in res.ranked} == {1}  # 7 splits over no tp > 1


def _trainer_refuses(shape: ModelShape, lay) -> bool:
    model = SimpleNamespace(
        n_head=shape.n_head,
        n_kv_head=shape.n_kv_head,
        mlp_hidden=shape.ffn_hidden,
        seq_len=shape.seq_len,
    )
    try:
        check_tp_model(model, lay.tp, lay.sequence_parallel)
        check_cp_model(model, lay.cp, lay.cp_impl, lay.tp, lay.sequence_parallel)
    except UserError:
        return True
    return False


def test_no_searched_layout_breaks_a_rule_of_the_trainer():
    """Random shapes (seeded): every layout the search enumerates passes the trainer's own tp and
    cp checks."""
    print(f"seed {TEST_SEED}")
    rng = random.Random(TEST_SEED)
    for _ in range(25):
        kv = rng.choice([1, 2, 3, 4, 6, 8])
        heads = kv * rng.choice([1, 2, 4, 8])
        seq, ffn = rng.choice([4096, 8192, 16384, 12288 + 2]), rng.choice([7, 96, 100, 1536])
        shape = ModelShape(rng.choice([2, 4, 6]), heads * 64, heads, kv, 32000, seq, ffn / 64)
        gpus = rng.choice([8, 16, 64])
        layouts = layout_enumeration._enumerate(shape, gpus, 8, 1024, (1,), ("none",))
        candidates = [lay for lay, why in layouts if why is None]
        assert all(not _trainer_refuses(shape, lay) for lay in candidates), shape


# valid inputs: the rules drop nothing that was valid, so plans and the backtest are unchanged


def _old_rules(shape, tp=1, cp=1, cp_impl="ring", sequence_parallel=False):
    """The divisibility the search checked before it called the trainer's rules: heads over tp,
    the sequence into 2·cp chunks, ulysses' heads over cp (no MLP width, k/v replication or
    sequence-parallel rule)."""
    broken = (
        shape.n_head % tp
        or shape.seq_len % (2 * cp) * (cp > 1)
        or (cp_impl == "ulysses" and (shape.n_head // tp) % cp)
    )
    return "broken" if broken else None


def _without_rules(monkeypatch):
    monkeypatch.setattr(layout_space, "parallel_refusal", _old_rules)
    layout_enumeration._enumerated.cache_clear()


@pytest.mark.parametrize("params, gpus", [(7e9, 64), (70e9, 512), (405e9, 2048)])
def test_plans_for_published_models_are_unchanged(monkeypatch, params, gpus):
    shape, cluster = ModelShape.from_params(params), Cluster.from_profile("h100-sxm", gpus)
    layout_enumeration._enumerated.cache_clear()
    ruled = search(shape, cluster, 1024, prune=True)
    _without_rules(monkeypatch)
    free = search(shape, cluster, 1024, prune=True)
    layout_enumeration._enumerated.cache_clear()
    assert ruled.best == free.best and ruled.ranked == free.ranked


def test_backtest_figures_are_unchanged(monkeypatch):
    layout_enumeration._enumerated.cache_clear()
    ruled = text_lines(backtest())
    _without_rules(monkeypatch)
    free = text_lines(backtest())
    layout_enumeration._enumerated.cache_clear()
    assert ruled == free and len(ruled) > 55


# item 5: copies of one run are one local check


def test_copies_of_a_run_count_once_in_the_local_check(tmp_path):
    shutil.copytree(CPU, tmp_path / "cpu")
    src = tmp_path / "cpu" / "fsdp-scaling" / "20250301-100100-000000"
    for i in range(5):
        shutil.copytree(src, src.parent / f"copy-{i}")
    base = calibrate([CPU], base=CPU.parent, warn=False)
    report = calibrate([tmp_path / "cpu"], base=tmp_path, warn=False)
    assert len(report.runs) == len(base.runs) + 5
    plain, checks = local_checks(base, CPU.parent), local_checks(report, tmp_path)
    assert len(checks) == len(plain)  # not 5 more rows
    assert [(c.what, c.measured_s, c.predicted_s) for c in checks] == [
        (c.what, c.measured_s, c.predicted_s) for c in plain
    ]  # a copy is no "other run" either
    [row] = [c for c in checks if c.run.endswith("20250301-100100-000000")]
    assert row.copies == tuple(f"cpu/fsdp-scaling/copy-{i}" for i in range(5))
    text = "\n".join(checks_table(checks, report))
    runs = len({c.run for c in checks})
    assert (
        f"The rows check {runs} distinct runs; 5 more folders repeating a run's guide inputs "
        "(`cpu/fsdp-scaling/copy-0`, `cpu/fsdp-scaling/copy-1`, `cpu/fsdp-scaling/copy-2` "
        "and 2 more) were counted once."
    ) in text


def test_a_real_rerun_is_not_a_copy(tmp_path):
    """Same config, another measurement: two runs, two checks (the guide compares them as
    run-to-run noise)."""
    shutil.copytree(CPU, tmp_path / "cpu")
    src = tmp_path / "cpu" / "fsdp-scaling" / "20250301-100100-000000"
    rerun = src.parent / "rerun"
    shutil.copytree(src, rerun)
    summary = json.loads((rerun / "summary.json").read_text())
    summary["guide_inputs"]["records"][0]["step_time_s"] *= 1.01
    (rerun / "summary.json").write_text(json.dumps(summary))
    checks = local_checks(calibrate([tmp_path / "cpu"], base=tmp_path, warn=False), tmp_path)
    assert sum(c.run.endswith("rerun") for c in checks) == 1 and not any(c.copies for c in checks)
