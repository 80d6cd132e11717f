"""Everything a command prints fits 100 columns, and no progress bar reaches a pipe (issue 40).

The tables are rendered from made-up rows wide enough to stress them (the experiments' real runs,
piped, are the slow tests at the end); the setup script's stages are read from its dry run.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pandas as pd
import pytest

from conftest import REPO, py
from dtrain.core import terminal

# this checkout's path, for the lines that name a run's files (app.py's `run complete: <dir>`)
CHECKOUT = "/work/main"
# tqdm and rich bars, cursor movement, colour
BAR_MARKS = ("\r", "\x1b[", "█", "it/s]", "%|")


def assert_fits(text: str, what: str) -> None:
    """Every line within terminal.WIDTH columns and no progress bar drawn."""
    wide = [(len(ln), ln) for ln in text.splitlines() if len(ln) > terminal.WIDTH]
    assert not wide, f"{what}: {len(wide)} lines over {terminal.WIDTH} columns, e.g. {wide[0]}"
    marks = [m for m in BAR_MARKS if m in text]
    assert not marks, f"{what}: progress bar characters {marks} in a pipe"


@pytest.fixture
def piped(monkeypatch):
    """In-process printing as into a pipe with COLUMNS=100 (the subprocess tests do it for real)."""
    monkeypatch.setenv("COLUMNS", "100")


def test_width_is_never_over_100_whatever_the_terminal_says(monkeypatch):
    for columns, want in (("100", 100), ("250", 100), ("80", 80), ("", 100), ("junk", 100)):
        monkeypatch.setenv("COLUMNS", columns)
        assert terminal.width() == want, columns


def test_bars_stay_off_a_pipe_and_slow_stages_say_a_line_each(capsys):
    assert not terminal.on_terminal()  # pytest captures stderr: as a pipe
    assert list(terminal.bar(range(3), desc="quiet")) == [0, 1, 2]
    manual = terminal.bar(total=5, desc="manual")
    manual.update(5)
    manual.close()
    assert list(terminal.bar(["a", "b"], desc="tp x sp", lines=True)) == ["a", "b"]
    assert list(terminal.bar(["a"], desc="not rank 0", show=False, lines=True)) == ["a"]
    with terminal.rich_progress() as progress:
        progress.add_task("hidden", total=1)
    out, err = capsys.readouterr()
    assert out == "" and err == "tp x sp: 1/2 done\ntp x sp: 2/2 done\n"


def test_a_pasted_command_breaks_between_arguments():
    argv = [
        "/a/long/venv/bin/python",
        "-m",
        "fp8_train",
        "-m",
        "recipe=fp32,emulated_delayed",
        "seed=0,1",
        "results_dir=" + "/x" * 40,
        "train.steps=20",
        "name=a b",
    ]
    text = terminal.shell_command(argv)
    assert_fits(text, "command")
    lines = text.splitlines()
    assert len(lines) > 1 and all(ln.endswith(" \\") for ln in lines[:-1])
    assert lines[-1].endswith("'name=a b'")  # quoted as the shell needs
    assert " ".join(ln.rstrip(" \\").strip() for ln in lines).split(" ")[:3] == argv[:3]


def test_tp_attention_table_fits(piped, capsys):
    from tp_attention.report import print_table

    ms = 1e-3
    rows = [
        {
            "tp": tp,
            "sequence_parallel": sp,
            "handrolled_s": 12345.6 * ms,
            "handrolled_async_s": 9999.9 * ms,
            "dtensor_s": 23456.7 * ms,
            "single_s": 34567.8 * ms,
            "single_same_threads_s": 45678.9 * ms,
            "overhead_factor": 12.34,
            "comm_share": 0.999,
            "comm_bytes_per_layer": 123456789,
        }
        for tp in (2, 16)
        for sp in (False, True)
    ]
    print_table(pd.DataFrame(rows), "tp-attention block: b=16 s=8192 d=8192 heads=64/8 bf16, cuda")
    out = capsys.readouterr().out
    assert_fits(out, "tp-attention table")
    assert "23456.7" in out and "120563" in out  # no number cut
    assert "same-thr = one rank with tp x threads" in " ".join(out.split())  # the legend


def test_tp_attention_cp_table_fits(piped, capsys):
    from tp_attention.cp.report import print_table

    rows = [
        {
            "seq_len": s,
            "cp": cp,
            "impl": impl,
            "median_s": 1.2345,
            "overhead": 1.5,
            "serial_s": 12.345,
            "sends_s": 1.5,
            "overlap_fraction": 0.5,
            "comm_bytes_per_layer": 2**30,
            "saved_bytes": 2**33,
        }
        for s in (8192, 131072)
        for cp in (1, 8)
        for impl in ("single", "ring", "ulysses", "tp_sp")
    ]
    print_table(pd.DataFrame(rows), "tp-attention cp: b=1 d=8192 heads=64/8 bf16 on cuda (nccl)")
    out = capsys.readouterr().out
    assert_fits(out, "cp table")
    assert "all-to-all (Ulysses)" in out and "131072" in out and "1048576" in out


def test_nccl_table_fits_at_its_largest_values():
    from allreduce_bench.report import nccl_table

    rows = [
        {
            "link_class": "inter_node",
            "dtype": "float8_e4m3fn",
            "collective": "reduce_scatter",
            "group_size": 1024,
            "groups": 8,
            "iters": 100,
            "warmup": 10,
            "nbytes": 2**33,
            "mode": mode,
            "count": 2**33,
            "type": "bfloat16",
            "redop": "prod",
            "root": 1023,
            "time_us": t,
            "algbw_GBps": 999.99,
            "busbw_GBps": 999.99,
            "wrong": 123456,
        }
        for mode in ("out_of_place", "in_place")
        for t in (9999.99, 99999.9, 9999999.0)
    ]
    text = nccl_table(pd.DataFrame(rows))
    assert_fits(text, "nccl table")
    assert "8589934592 8589934592 bfloat16  prod 1023 9999999" in text


def test_allreduce_fit_table_fits(piped, capsys):
    from allreduce_bench.report import print_fits

    fit = {
        "collective": "reduce_scatter",
        "link_class": "inter_node",
        "dtype": "float8_e4m3fn",
        "world_size": 1024,
        "alpha_us": 12345.6,
        "alpha_clamped": True,
        "beta_GBps": 123.0,
        "r2": 0.999,
        "n_points": 30,
        "beta_pct_of_theoretical": 99.0,
    }
    print_fits([fit, {**fit, "beta_pct_of_theoretical": None}])
    assert_fits(capsys.readouterr().out, "α–β fit table")


def test_fsdp_study_table_fits(piped, capsys):
    from fsdp_scaling.report import PRINTED, print_study

    row = {
        "strategy": "zero3",
        "layout": "tp8xpp4",
        "scaling": "strong",
        "model": "1b",
        "world_size": 1024,
        "tokens_per_s": 12345678.0,
        "step_time_s": 12.3456,
        "mfu": 0.456,
        "efficiency": 0.99,
        "step_time_vs_ddp": 1.23,
        "overlap_fraction": 0.5,
        "exposed_comm_s": 1.2345,
        "peak_mem_bytes": 80 * 2**30,
    }
    print_study(pd.DataFrame([row, {**row, "strategy": "hsdp", "step_time_vs_ddp": float("nan")}]))
    out = capsys.readouterr().out
    assert_fits(out, "fsdp study table")
    assert "12345678" in out and "80GiB" in out and len(PRINTED) == 13


def test_help_fits():
    for args in (["--help"], ["capstone", "--help"], ["guide", "--help"]):
        r = py("-m", "dtrain.cli.main", *args, env={"COLUMNS": "100"}, timeout=60)
        assert r.returncode == 0, r.stderr
        assert_fits(r.stdout + r.stderr, "dtrain " + " ".join(args))


def _setup(env: dict, tty: bool = False) -> str:
    cmd = [str(REPO / "scripts" / "setup-venv")]
    if tty:  # a pseudo-terminal: what `make test` typed at a shell sees
        cmd = ["script", "-qec", " ".join(cmd), "/dev/null"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.replace("\r\n", "\n")


def test_setup_says_each_stage_and_keeps_pip_quiet_in_a_pipe(tmp_path):
    """DRY_RUN=1 against a venv that does not exist: its stages and the pip commands it runs."""
    venv = tmp_path / "venv"
    env = {"DRY_RUN": "1", "VENV": str(venv), "PATH": "/usr/bin:/bin"}  # no nvidia-smi: CPU
    assert _setup(env).splitlines() == [
        f"setup: creating {venv}",
        f"+ python3 -m venv {venv}",
        "setup: downloading torch==2.13.0 (CPU build, ~200 MB: a minute or two) ...",
        f"+ {venv}/bin/python -m pip install -q --progress-bar off torch==2.13.0",
        f"setup: installing the project (.[dev]) and its dependencies into {venv} ...",
        f"+ {venv}/bin/python -m pip install -q --progress-bar off -e .[dev]",
    ]
    assert not venv.exists()
    assert "export PIP_DISABLE_PIP_VERSION_CHECK=1" in (REPO / "scripts" / "setup-venv").read_text()
    if shutil.which("script"):
        on_tty = _setup(env, tty=True)
        assert "pip install --progress-bar on torch==2.13.0" in on_tty and " -q " not in on_tty


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("-m", "tp_attention"),
        ("-m", "tp_attention.cp"),
        ("-m", "allreduce_bench"),
        ("-m", "fsdp_scaling", "model.preset=tiny", "train.steps=6", "world_size=2", "train.tp=2"),
        ("-m", "fp8_train", "train.steps=10"),
    ],
    ids=lambda a: " ".join(a[1:3]),
)
def test_experiments_piped_fit_100_columns(args, tmp_path):
    """Each experiment at its small default, stdout and stderr into pipes, COLUMNS=100 (~20-40 s
    each). Its run folder is the default one (results/<experiment>/<time>) of a checkout at
    CHECKOUT: lines naming a path are measured with this checkout's path, not pytest's longer
    one."""
    r = py(*args, env={"COLUMNS": "100"}, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_fits(r.stdout.replace(str(tmp_path), CHECKOUT), " ".join(args) + " stdout")
    assert_fits(r.stderr.replace(str(tmp_path), CHECKOUT), " ".join(args) + " stderr")
