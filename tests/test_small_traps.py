"""The small traps of issue 40 (item 8): minimums and real key names in messages, did-you-mean for
unknown keys, Slurm errors and job ids the same through submitit as through `launcher=slurm`, a cp
run's breakdown, tp-attention's missed targets, `dtrain runs` telling sweep points apart, and the
guide's model colours."""

from __future__ import annotations

import itertools
import json
import shutil
import stat
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import py
from dtrain.cli.main import main
from dtrain.core.errors import UserError
from dtrain.run import precheck
from dtrain.slurm import submitit_sweep

FIXTURE_RUN = Path(__file__).parent / "fixtures/results/cpu/fsdp-scaling/20250301-100100-000000"


def refusal(module: str, *overrides: str) -> str:
    """The one error line `python -m <module> overrides...` would print (checked in process)."""
    conf = importlib_module(f"{module}.conf")
    validate = getattr(importlib_module(f"{module}.checks"), "validate", None)
    with pytest.raises(UserError) as e:
        precheck.check_overrides(conf.__name__, "config", list(overrides), validate)
    return str(e.value)


def importlib_module(name: str):
    import importlib

    return importlib.import_module(name)


# ------------------------------------------------------------------ minimums and key names


def test_too_few_steps_says_the_minimum_and_the_real_keys():
    assert refusal("fsdp_scaling", "train.steps=4") == (
        "train.steps=4 leaves no timed step after train.timing_warmup=3 and profile.steps=2: "
        "set train.steps>=6, or lower train.timing_warmup or profile.steps, "
        "or profile.enabled=false"
    )
    other = refusal("fsdp_scaling", "train.steps=4", "train.timing_warmup=2", "profile.steps=3")
    assert other.startswith(
        "train.steps=4 leaves no timed step after train.timing_warmup=2 and profile.steps=3: "
        "set train.steps>=6,"
    )
    # the minimum it names runs past the check
    precheck.check_overrides(
        "fsdp_scaling.conf", "config", ["train.steps=6", "model.preset=tiny"], None
    )


def test_a_negative_count_names_its_own_key():
    assert refusal("fsdp_scaling", "train.timing_warmup=-1") == (
        "train.timing_warmup=-1 must be >= 0"
    )
    assert refusal("fsdp_scaling", "train.log_every=-2") == "train.log_every=-2 must be >= 0"


# ------------------------------------------------------------------ did you mean


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "train.timing_warmpu=3",
            "unknown key train.timing_warmpu: did you mean train.timing_warmup? (all keys: --cfg "
            "job)",
        ),
        (
            "timing_warmup=3",  # a key of a node given at the top level
            "unknown key timing_warmup: did you mean train.timing_warmup? (all keys: --cfg job)",
        ),
        (
            "train.stpes=3",  # a key of the same node is compared by its own name: not train.tp
            "unknown key train.stpes: did you mean train.steps? (all keys: --cfg job)",
        ),
        (
            "slurm.partiton=gpu",
            "unknown key slurm.partiton: did you mean slurm.partition? (all keys: --cfg job)",
        ),
        (
            "+train.timing_warmpu=3",  # added with +: refused by the typed train node, the same way
            "unknown key train.timing_warmpu: did you mean train.timing_warmup? (all keys: --cfg "
            "job)",
        ),
        (
            "model.foo=1",  # nothing close: a few of the node's keys, never all of them
            "unknown key model.foo: model's keys are preset, seq_len, n_layer, ... (all keys: "
            "--cfg job)",
        ),
        (
            "foo=1",
            "unknown key foo: the top-level keys are subproject, launcher, ... (all keys: --cfg "
            "job)",
        ),
    ],
)
def test_unknown_key_is_one_short_line_with_did_you_mean(override, line):
    assert refusal("fsdp_scaling", override) == line
    assert len("error: " + line) <= 100


def test_unknown_key_on_the_command_line_exit_2(tmp_path):
    out = py("-m", "fsdp_scaling", "train.timing_warmpu=3", f"results_dir={tmp_path}", timeout=60)
    assert out.returncode == 2 and out.stderr == (
        "error: unknown key train.timing_warmpu: did you mean train.timing_warmup? "
        "(all keys: --cfg job)\n"
    )
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ Slurm through submitit

SINFO = "node1|debug*|2|22899|(null)\nnode2|debug*|2|22899|(null)"


def fake_sinfo(folder: Path) -> str:
    """A PATH whose `sinfo` lists two 2-CPU nodes of partition debug (none for any other -p)."""
    import os

    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "sinfo"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"-p "*) case "$*" in *"-p debug"*) ;; *) exit 0;; esac;;'
        " esac\n"
        f"cat <<'EOF'\n{SINFO}\nEOF\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def launcher(**kw):
    base = {
        "partition": None,
        "nodes": 1,
        "tasks_per_node": 1,
        "cpus_per_task": None,
        "mem_gb": None,
        "gpus_per_node": None,
        "gres": None,
        "submitit_folder": "/s/.submitit/%j",
    }
    return OmegaConf.create({**base, **kw})


def test_sweep_fits_check_names_the_launcher_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_sinfo(tmp_path / "bin"))
    submitit_sweep.check_fits(launcher(partition="debug", tasks_per_node=2))  # fits: silent
    with pytest.raises(UserError) as e:
        submitit_sweep.check_fits(launcher(partition="gpu", tasks_per_node=2, gpus_per_node=8))
    assert str(e.value) == (
        "Slurm partition 'gpu' has no nodes (sinfo): set "
        "hydra.launcher.partition to one that `sinfo` lists"
    )
    with pytest.raises(UserError) as e:
        submitit_sweep.check_fits(launcher(tasks_per_node=2, gres="gpu:4"))
    assert str(e.value).startswith(
        "Slurm can never run this job: it asks for 1 node(s) with 2 CPUs, 4 GPUs"
    )
    assert str(e.value).endswith(
        "lower hydra.launcher.tasks_per_node or hydra.launcher.cpus_per_task, add "
        "hydra.launcher.nodes, or pick another hydra.launcher.partition"
    )
    assert "slurm." not in str(e.value)


def test_submitit_sweep_on_a_missing_partition_is_the_launcher_slurm_line(tmp_path):
    """Before sbatch (which would answer with a raw gres error), nothing submitted, nothing left."""
    out = py(
        "-m",
        "dtrain.run.selftest",
        "-m",
        "numel=16,64",
        "world_size=2",
        f"results_dir={tmp_path / 'r'}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.gpus_per_node=8",
        env={"PATH": fake_sinfo(tmp_path / "bin")},
        timeout=90,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: Slurm partition 'gpu' has no nodes (sinfo): set hydra.launcher.partition to "
        "one that `sinfo` lists"
    ]
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").rglob("*"))


def test_the_job_id_is_printed_as_soon_as_sbatch_answers(monkeypatch, capsys):
    from submitit.slurm.slurm import SlurmExecutor

    class Job:
        job_id = "4242"

    monkeypatch.setattr(SlurmExecutor, "_submit_command", lambda self, command: Job())
    seen = []

    def announce(job):
        seen.append(submitit_sweep.submitted_line(job.job_id, 2, "/s/%j"))

    with submitit_sweep._refusals(announce):
        job = SlurmExecutor._submit_command(object(), "sbatch ...")
        # said before the sweep goes on to wait for its points
        assert seen == ["submitted Slurm job array 4242 (2 point(s)); logs in /s/4242_*"]
    assert job.job_id == "4242" and SlurmExecutor._submit_command(None, "x").job_id == "4242"


@pytest.mark.slow  # ~6 s of Slurm; launcher=slurm's job id line is read by every Slurm test
@pytest.mark.slurm
def test_submitit_sweep_prints_its_job_id_before_it_finishes(slurm_cluster, tmp_path):
    out = py(
        "-m",
        "dtrain.run.selftest",
        "-m",
        "numel=16,64",
        "world_size=2",
        f"results_dir={tmp_path}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.tasks_per_node=2",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    [i] = [n for n, line in enumerate(lines) if line.startswith("submitted Slurm job array ")]
    job = lines[i].split()[4]
    assert "(2 point(s)); logs in " in lines[i] and lines[i].endswith(f"/.submitit/{job}_*")
    assert i < next(n for n, line in enumerate(lines) if line.startswith("sweep complete"))


# ------------------------------------------------------------------ fsdp-scaling with cp


def cp_result() -> dict:
    ones = {"params": 1, "grads": 1, "optimizer": 1}
    return {
        "strategy": "ddp",
        "world_size": 2,
        "model_params": 1,
        "flops_per_token": 1,
        "tokens_per_s": 1e3,
        "step_time_s": 0.1,
        "tflops_per_rank": 0.01,
        "mfu": 0.1,
        "peak_flops": 1e10,
        "peak_flops_source": "x",
        "peak_mem_bytes": 1 << 20,
        "state_bytes": ones,
        "state_bytes_formula": ones,
        "state_bytes_ideal": ones,
        "shard_degree": 2,
        "overlap": {"overlap_fraction": 0.5, "comm_s": 0.01, "exposed_comm_s": 0.005},
        "mixed_precision": "fp32",
        "device": "cpu",
        "backend": "gloo",
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "cp": 2,
        "cp_impl": "ring",
        "breakdown": {"step_s": 0.1, "compute_s": 0.05, "cp_comm_s": 0.02},
    }


def test_a_cp_run_names_cp_in_its_breakdown_and_dp_in_its_comm_columns():
    from rich.console import Console

    from fsdp_scaling.report import BREAKDOWN, layout_name
    from fsdp_scaling.summary import print_tables

    console = Console(width=100, record=True)
    print_tables(cp_result(), console)
    text = console.export_text()
    assert "step breakdown on rank 0, dp1 x tp1 x pp1 x cp2 (ring) (profiled steps, s/step)" in text
    assert "DP comm s" in text and "DP exposed s" in text and "comm s/step" not in text
    assert "s = seconds per step; DP = the data-parallel gradient sync (TP, CP, PP comm" in text
    assert max(map(len, text.splitlines())) <= 100
    # the study report: a cp run's layout and its CP comm column
    assert layout_name({"tp": 1, "pp": 1, "cp": 2}) == "tp1xpp1xcp2"
    assert layout_name({"tp": 2, "pp": 1}) == "tp2xpp1" and "cp_comm_s" in BREAKDOWN


# ------------------------------------------------------------------ tp-attention targets


def test_tp_attention_says_missed_or_met():
    from tp_attention.report import TARGET_VS_DTENSOR, TARGET_VS_SAME_THREADS, target_lines, targets

    slow = TARGET_VS_DTENSOR + 0.27
    entries = [
        {
            "tp": 2,
            "sequence_parallel": False,
            "handrolled_s": slow,
            "dtensor_s": 1.0,
            "single_same_threads_s": None,
        },
        {
            "tp": 2,
            "sequence_parallel": True,
            "handrolled_s": 0.5,
            "dtensor_s": 1.0,
            "single_same_threads_s": 1.0,
        },
    ]
    off, on = (target_lines(t) for t in targets(entries))
    assert off == [
        f"target at tp=2, SP=off: hand/DTensor {slow:.2f} <= {TARGET_VS_DTENSOR} missed",
        f"target at tp=2, SP=off: hand/same-threads - <= {TARGET_VS_SAME_THREADS} not measured",
    ]
    assert on == [
        f"target at tp=2, SP=on: hand/DTensor 0.50 <= {TARGET_VS_DTENSOR} met",
        f"target at tp=2, SP=on: hand/same-threads 0.50 <= {TARGET_VS_SAME_THREADS} met",
    ]


# ------------------------------------------------------------------ dtrain runs


def sweep_of_runs(root: Path, n: int) -> Path:
    """A sweep folder with long names, `n` complete points differing by train.strategy."""
    sweep = (
        root
        / ("results-of-a-long-experiment-name" * 2)
        / "fsdp-scaling"
        / "multirun-20261127-063855-207738"
    )
    for point, strategy in zip(range(n), itertools.cycle(("ddp", "zero2", "zero3"))):
        run = sweep / str(point)
        shutil.copytree(FIXTURE_RUN, run)
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(
            json.dumps(
                [
                    "model.preset=tiny",
                    "world_size=2",
                    f"train.strategy={strategy}",
                    f"results_dir={root}",
                ]
            )
        )
    return sweep


def test_dtrain_runs_tells_sweep_points_apart_in_100_columns(tmp_path, capsys):
    sweep_of_runs(tmp_path, 3)
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, lines
    header, *rows = lines[1 : 4 + 1]
    assert header.split()[-1] == "overrides"
    # the shared overrides are left out; each point ends with its number and its strategy
    strategies = [f"train.strategy={s}" for s in ("ddp", "zero2", "zero3")]
    assert [r.split()[-1] for r in rows] == strategies
    assert [r.split()[0][-2:] for r in rows] == ["/0", "/1", "/2"]
    assert all(r.split()[0].startswith("results-o") and "…" in r.split()[0] for r in rows)


def test_dtrain_runs_wide_shows_every_override(tmp_path, capsys):
    sweep_of_runs(tmp_path, 1)
    assert main(["runs", "--wide", str(tmp_path)]) == 0
    assert "model.preset=tiny world_size=2 train.strategy=ddp" in capsys.readouterr().out


def test_compact_table_cuts_paths_in_the_middle():
    from dtrain.cli.runs import shorten

    assert shorten("fsdp-scaling/multirun-20261127-063855-207738/12", 20) == "fsdp-s…855-207738/12"
    assert len(shorten("x" * 300, 37)) == 37 and shorten("short", 37) == "short"


# ------------------------------------------------------------------ the guide's colours


def test_each_model_has_its_own_colour_and_marker():
    from dtrain.guide.figures import model_styles
    from dtrain.guide.matrix import MODELS

    palette, markers = model_styles()
    assert len(palette) == len(markers) == len(set(markers)) == len(MODELS) == 7

    def far(colours) -> float:
        pairs = itertools.combinations(colours, 2)
        return min(sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5 for a, b in pairs)

    from dtrain.results import plots

    assert far(palette) > 0.3  # the old colorblind palette's orange and vermillion were 0.19 apart
    assert far(plots.sns.color_palette("colorblind", 7)) < 0.3
