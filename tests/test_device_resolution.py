"""`device` is resolved once, in the launching process, for every local rank: with one (faked) GPU
and world_size=2 that is a one-line error saying what to set, or an all-CPU run when device=cpu."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dtrain.core.errors import UserError
from dtrain.run import dist as ddist
from dtrain.run.launch import check_local, launch


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def cfg_of(world_size: int, device: str):
    return OmegaConf.create(
        {
            "launcher": "local",
            "world_size": world_size,
            "backend": "auto",
            "device": device,
            "seed": 0,
            "dist_timeout_s": 60,
            "threads_per_rank": 1,
            "subproject": "test",
        }
    )


@pytest.mark.parametrize(
    "gpus, world_size, device, resolved",
    [
        (0, 2, "auto", "cpu"),
        (1, 1, "auto", "cuda"),
        (2, 2, "auto", "cuda"),
        (1, 2, "cpu", "cpu"),
        (2, 2, "cuda", "cuda"),
    ],
)
def test_device_is_resolved_once_for_all_local_ranks(
    monkeypatch, gpus, world_size, device, resolved
):
    fake_gpus(monkeypatch, gpus)
    assert check_local(cfg_of(world_size, device)) == resolved


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_cuda_ranks_than_gpus_is_one_line_that_says_what_to_set(monkeypatch, device):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(UserError) as e:
        check_local(cfg_of(2, device))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (
        "world_size=2 asks for 2 CUDA ranks but this host has 1 GPU(s) (one rank per GPU): "
        "set world_size=1, or device=cpu for 2 CPU ranks, or use launcher=slurm"
    )


def test_in_a_job_a_rank_without_its_own_gpu_is_an_error_not_a_cpu_rank(monkeypatch):
    fake_gpus(monkeypatch, 1)
    assert ddist.pick_device("auto", 0) == torch.device("cuda", 0)
    with pytest.raises(
        UserError, match=r"local rank 1 has no GPU of its own \(this node has 1; one rank per GPU\)"
    ):
        ddist.pick_device("auto", 1)
    assert ddist.pick_device("cpu", 1) == torch.device("cpu")
    fake_gpus(monkeypatch, 0)
    with pytest.raises(UserError, match="device=cuda but this host sees no CUDA GPU"):
        ddist.pick_device("cuda", 0)


def _where(ctx) -> tuple[str, str, str]:
    import torch.distributed as dist

    out = [None] * ctx.world_size
    dist.all_gather_object(out, (str(ctx.device), ctx.backend, ctx.cfg.device))
    return out


def test_device_cpu_with_one_gpu_runs_every_rank_on_cpu(monkeypatch, tmp_path):
    fake_gpus(monkeypatch, 1)  # the parent sees a GPU; the ranks are told cpu and stay there
    result, _ = launch(_where, cfg_of(2, "cpu"), tmp_path)
    assert result == [("cpu", "gloo", "cpu"), ("cpu", "gloo", "cpu")]


def test_the_default_world_size_on_a_one_gpu_host_is_one_line_from_the_command_line(tmp_path):
    from conftest import py

    fake = (
        "import sys, torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = "
        "lambda: 1; "
        f"sys.argv = ['selftest', 'results_dir={tmp_path}']; from dtrain.run.selftest import "
        "main; main()"
    )
    out = py("-c", fake, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: world_size=2 asks for 2 CUDA ranks but this host has 1 GPU(s) (one rank per "
        "GPU): set world_size=1, or device=cpu for 2 CPU ranks, or use launcher=slurm"
    )
    assert not list(tmp_path.rglob("config.yaml"))  # nothing left behind
