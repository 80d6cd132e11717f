"""Hardening, third round: the command line before Hydra starts (dtrain.run.precheck). A sweep too
large is refused from the sizes of its values at once, many points failing one way are one line, a
key
given twice is refused, a huge value is clipped in the error line, selftest's fail_rank and
tp-attention's measured lists are checked (docs/HARDENING.md)."""

from __future__ import annotations

import time

import pytest
from omegaconf import OmegaConf

from conftest import py
from dtrain.core.errors import UserError, clip, clip_words
from dtrain.run import precheck, precheck_sweep, rundir
from dtrain.run.hydra_argv import parse_overrides
from dtrain.run.selftest import validate as selftest_validate


def _selftest(args: list[str]) -> None:
    precheck.check_overrides("dtrain.conf", "selftest", args, selftest_validate)


def _refused(args: list[str], module: str = "fsdp_scaling.conf") -> str:
    with pytest.raises(UserError) as e:
        precheck.check_overrides(module, "config", args, None)
    return str(e.value)


def _cli(tmp_path, *args: str, timeout: float = 120):
    """`python -m <args>`: exit 2, stderr's lines, and no run directory left."""
    out = py("-m", *args, f"results_dir={tmp_path}", timeout=timeout)
    assert out.returncode == 2, out.stdout + out.stderr
    assert not list(tmp_path.rglob("config.yaml")) and not list(tmp_path.rglob(rundir.OWNER))
    return [line for line in out.stderr.splitlines() if line.strip()]


HUGE = (
    "the sweep has 19,980,002 points (train.lr: 9,990,001 values x seed: 2 values); at most 1,000 "
    "points are run in one sweep: narrow the ranges or split the sweep"
)


def test_a_huge_sweep_is_refused_at_once_from_its_sizes(tmp_path):
    t0 = time.monotonic()
    assert _refused(["-m", "train.lr=range(1e-3,1,1e-7)", "seed=1,2"]) == HUGE
    assert time.monotonic() - t0 < 2  # counted, never expanded (expanding alone takes ~20 s)
    t0 = time.monotonic()
    assert _cli(tmp_path, "fsdp_scaling", "-m", "train.lr=range(1e-3,1,1e-7)", "seed=1,2") == [
        f"error: {HUGE}"
    ]
    assert time.monotonic() - t0 < 20  # the process, whatever the load: no minutes of silence
    # the cap itself: 1,000 points pass the count (and are then checked one by one), 1,001 do not
    assert _refused(["-m", "seed=range(0,1001)"]).startswith(
        "the sweep has 1,001 points (seed: 1,001 values)"
    )
    assert (
        precheck_sweep.sweep_size(parse_overrides(["seed=range(0,1000)"])[0])
        == precheck_sweep.MAX_SWEEP_POINTS
    )


def test_many_points_failing_one_way_are_one_line(capsys):
    with pytest.raises(UserError) as e:
        _selftest(["-m", "world_size=2", "fail_rank=range(-2,40)"])
    lines = str(e.value).split("\nerror: ")
    assert lines == [
        "sweep points #0, #1 (2 points): fail_rank=... must be >= 0 (a rank, 0 to 1; or null: no "
        "rank fails)",
        "sweep points #4, #5, #6, ... (38 points): fail_rank=... must be < world_size=2 (a rank, "
        "0 to 1; or null: no rank fails)",
        "40 of 42 sweep points are invalid; none was run",
    ]
    assert capsys.readouterr().err == ""  # 42 points, off a terminal: no progress line yet


def test_grouping_1000_errors_and_differing_kinds():
    errors = [
        (n, f"train.lr={-n}", f"train.lr={-n} must be a finite number > 0") for n in range(1000)
    ]
    errors += [
        (1000 + n, f"model.preset=p{n}", f"model: unknown model preset 'p{n}'") for n in range(2)
    ]
    errors += [(2000 + n, "x=1", f"kind {n}: bad") for n in range(6)]
    assert precheck_sweep.group_errors(errors, 3000) == [
        "sweep points #0, #1, #2, ... (1,000 points): train.lr=... must be a finite number > 0",
        "sweep points #1000, #1001 (2 points): model: unknown model preset '...'",
        "sweep point #2000 (x=1): kind 0: bad",
        "sweep point #2001 (x=1): kind 1: bad",
        "sweep point #2002 (x=1): kind 2: bad",
        "3 more sweep points fail in 3 other ways (not shown)",
        "1,008 of 3,000 sweep points are invalid; none was run",
    ]


def test_progress_off_a_terminal_is_a_line_every_so_many_points(monkeypatch, capsys):
    monkeypatch.setattr(precheck_sweep, "PROGRESS_EVERY", 10)
    _selftest(["-m", "world_size=1", "numel=range(1,26)"])
    assert capsys.readouterr().err.splitlines() == [
        "checked 10 of 25 sweep points",
        "checked 20 of 25 sweep points",
    ]


@pytest.mark.slow
def test_1000_bad_points_on_the_command_line_are_one_grouped_line(tmp_path):
    """~1-2 minutes: every point is composed and validated (the cap's worst case)."""
    lines = _cli(
        tmp_path,
        "dtrain.run.selftest",
        "-m",
        "world_size=2",
        "fail_rank=range(2,1002)",
        timeout=600,
    )
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [
        "error: sweep points #0, #1, #2, ... (1,000 points): fail_rank=... must be < world_size=2 "
        "(a rank, 0 to 1; or null: no rank fails)",
        "error: 1,000 of 1,000 sweep points are invalid; none was run",
    ]
    assert [line for line in lines if not line.startswith("error: ")] == [
        f"checked {n:,} of 1,000 sweep points" for n in (250, 500, 750)
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["train.lr=1", "train.lr=2"],
            "train.lr is given twice (train.lr=1, train.lr=2): keep one",
        ),
        (
            ["train.lr=1", "+train.lr=2", "++train.lr=3"],
            "train.lr is given 3 times (train.lr=1, +train.lr=2, ++train.lr=3): keep one",
        ),
        (["~train.lr", "train.lr=1"], "train.lr is given twice (~train.lr, train.lr=1): keep one"),
        (
            ["hydra/launcher=basic", "hydra/launcher=submitit_slurm"],
            "hydra/launcher is given twice (hydra/launcher=basic, hydra/launcher=submitit_slurm): "
            "keep one",
        ),
        (
            ["-m", "train.lr=1,2", "train.lr=3"],
            "train.lr is given twice (train.lr=1,2, train.lr=3): keep one",
        ),
    ],
)
def test_a_key_given_twice_is_refused(args, message):
    assert _refused(args) == message


def test_a_key_given_twice_on_the_command_line(tmp_path):
    assert _cli(tmp_path, "fsdp_scaling", "train.lr=1", "train.lr=2") == [
        "error: train.lr is given twice (train.lr=1, train.lr=2): keep one"
    ]
    assert _cli(tmp_path, "fsdp_scaling", "-m", "seed=1,2", "seed=3") == [
        "error: seed is given twice (seed=1,2, seed=3): keep one"
    ]


def test_clip_keeps_a_value_short():
    assert clip("x" * 200) == "x" * 200
    assert clip("x" * 100_000) == "x" * 200 + "... (100,000 characters)"
    assert clip_words(f"a='{'y' * 300}' b") == f"a='{'y' * 197}... (304 characters) b"
    assert (
        clip_words(f"v={clip('z' * 500)} ok") == f"v={'z' * 200}... (500 characters) ok"
    )  # not twice


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["train.steps=" + "x" * 100_000],
            f"error: train.steps='{'x' * 199}... (100,002 characters) must be an integer",
        ),
        (
            ["model.preset=" + "x" * 100_000],
            f"error: model: unknown model preset '{'x' * 199}... (100,003 characters) choose one "
            "of",
        ),
        (
            ["foo" + "x" * 100_000 + "=1"],
            f"error: unknown key foo{'x' * 197}... (100,003 characters): no key is "
            "that long: check the override",
        ),
        (
            ["-m", "train.lr=1," + "x" * 100_000],
            f"error: sweep point #1 (train.lr={'x' * 191}... (",
        ),
    ],
)
def test_a_100kB_value_is_clipped_in_the_error_line(tmp_path, args, message):
    lines = _cli(tmp_path, "fsdp_scaling", *args)
    assert lines[0].startswith(message) and all(len(line) < 700 for line in lines), [
        x[:300] for x in lines
    ]


def test_selftest_fail_rank_must_be_a_rank(tmp_path):
    assert _cli(tmp_path, "dtrain.run.selftest", "world_size=2", "fail_rank=5") == [
        "error: fail_rank=5 must be < world_size=2 (a rank, 0 to 1; or null: no rank fails)"
    ]
    for args, message in (
        (["world_size=2", "fail_rank=-1"], "fail_rank=-1 must be >= 0 (a rank, 0 to 1; or null"),
        (["numel=0"], "numel=0 must be an integer >= 1"),
        (["work_s=nan"], "work_s=nan must be a finite number of seconds >= 0"),
    ):
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            _selftest(args)
    _selftest(["world_size=2", "fail_rank=1"])
    _selftest(["world_size=2", "fail_rank=null"])


def test_tp_attention_cp_measures_each_value_once(tmp_path):
    assert _cli(tmp_path, "tp_attention.cp", "train.cp=[2,2]") == [
        "error: train.cp=[2, 2] names 2 twice: each value is measured once: drop the repeat"
    ]
    from tp_attention.cp.study import validate

    for over, message in (
        ({"model": {"seq_len": [256, 512, 256]}}, "model.seq_len=[256, 512, 256] names 256 twice"),
        ({"train": {"cp_impl": ["ring", "ring"]}}, "train.cp_impl=[ring, ring] names ring twice"),
    ):
        cfg = OmegaConf.merge(_tp_cfg("cp"), over)
        with pytest.raises(UserError, match=message.replace("[", r"\[")):
            validate(cfg)


@pytest.mark.parametrize(
    "over, message",
    [
        (
            {"train": {"tp": [1, 2, 1]}},
            "train.tp=[1, 2, 1] names 1 twice: each value is measured once: drop the repeat",
        ),
        (
            {"train": {"sequence_parallel": [True, True]}},
            "train.sequence_parallel=[true, true] names true twice",
        ),
        (
            {"impls": ["single", "handrolled", "single"]},
            "impls=[single, handrolled, single] names single twice",
        ),
    ],
)
def test_tp_attention_bench_measures_each_value_once(over, message):
    from tp_attention.config import check_bench

    with pytest.raises(UserError) as e:
        check_bench(OmegaConf.merge(_tp_cfg("config"), over))
    assert str(e.value).startswith(message)


def _tp_cfg(name: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="tp_attention.conf", version_base="1.3"):
        return compose(
            config_name=name, overrides=["model.preset=tiny"] if name == "config" else []
        )
