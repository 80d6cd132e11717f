"""Shared fixtures: run a project command in a subprocess, the config of ranks launched on this
CPU and of a few training steps, find the local Slurm cluster, seed every test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent


def run_cmd(
    args: list[str], timeout: float = 120, env: dict | None = None, cwd: Path | None = None
):
    """Run `python -m ...`-style commands with this interpreter; returns CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("RANK", None)
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO
    )


def py(*args: str, timeout: float = 120, **kw):
    return run_cmd([sys.executable, *args], timeout=timeout, **kw)


def local_cpu_run(world_size: int, timeout_s: int = 120, seed: int = 0, **extra):
    """The config `dtrain.run.launch.launch` takes for `world_size` gloo ranks on this CPU, one
    thread each, plus `extra` (what the test's rank function reads)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "launcher": "local",
            "world_size": world_size,
            "backend": "gloo",
            "device": "cpu",
            "seed": seed,
            "dist_timeout_s": timeout_s,
            "threads_per_rank": 1,
            "subproject": "test",
            **extra,
        }
    )


def few_steps(steps: int, **kw):
    """A TrainConfig of `steps` small steps (micro-batch 1, global batch 4, no logging or timing
    warm-up, 20K tokens of data), `kw` overriding any field."""
    from dtrain.train import TrainConfig

    return TrainConfig(
        **{
            "steps": steps,
            "micro_batch": 1,
            "global_batch": 4,
            "log_every": 0,
            "dataset_tokens": 20_000,
            "timing_warmup": 0,
            **kw,
        }
    )


def slurm_available() -> str | None:
    """Why Slurm tests cannot run, or None when a cluster answers."""
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (scripts/slurm-cluster install)"
    if not os.environ.get("SLURM_CONF"):
        conf = REPO / ".slurm" / "etc" / "slurm.conf"
        # `status` answers in ~0.1 s; sinfo against a stopped cluster takes ~10 s to fail
        if (
            not conf.exists()
            or subprocess.run(
                [str(REPO / "scripts" / "slurm-cluster"), "status"], capture_output=True
            ).returncode
            != 0
        ):
            return (
                'no cluster: scripts/slurm-cluster start, then eval "$(scripts/slurm-cluster env)"'
            )
        os.environ["SLURM_CONF"] = str(conf)
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if (
        out.returncode != 0
        or "idle" not in out.stdout
        and "mix" not in out.stdout
        and "alloc" not in out.stdout
    ):
        return f"Slurm cluster not up: {out.stderr.strip() or out.stdout.strip()}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    return os.environ["SLURM_CONF"]


TEST_SEED = int(os.environ.get("DTRAIN_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def seeded_randomness():
    """Every test starts from the same random state (random, numpy, torch), seed printed so a
    failure shows it; tests that need their own seed set it after this. DTRAIN_TEST_SEED=N picks
    another."""
    import random

    import numpy
    import torch

    random.seed(TEST_SEED)
    numpy.random.seed(TEST_SEED)
    torch.manual_seed(TEST_SEED)
    print(f"seed {TEST_SEED}")


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def slurm_nodes_idle() -> int:
    """How many nodes of the cluster are usable (after slurm_available() said it is up)."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10
    )
    return len(
        {
            line.split()[0]
            for line in out.stdout.splitlines()
            if len(line.split()) == 2
            and line.split()[1].rstrip("*~#") in ("idle", "mixed", "allocated")
        }
    )


@pytest.fixture(scope="session")
def slurm_two_nodes(slurm_cluster):
    """A cluster with at least two nodes (`scripts/slurm-cluster start --nodes 2`)."""
    n = slurm_nodes_idle()
    if n < 2:
        pytest.skip(
            f"needs a 2-node Slurm cluster, this one has {n} usable node(s): "
            "scripts/slurm-cluster restart --nodes 2"
        )
    return slurm_cluster
