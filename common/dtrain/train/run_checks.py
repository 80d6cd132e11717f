"""The checks a training run's command line gets before any process starts (fsdp-scaling,
fp8-train).

Its values first, without torch: train.* against the world size and the model, model.*, the data.
Then what needs torch: the device a local run gets (precision `auto`, a CUDA-only context
parallelism), whether the model fits this host's memory, and a resume's checkpoint. A wrong value is
refused in a fraction of a second, before torch is imported.
"""

from __future__ import annotations

from dtrain.core import checks
from dtrain.core.nodes import model_config
from dtrain.run.launch import mode_of
from dtrain.train.config import TrainConfig


def check_values(cfg) -> tuple:
    """(TrainConfig resolved for the world size, GPTConfig) of a run's `train:` and `model:`
    nodes, or a UserError naming the first key that cannot run."""
    train = TrainConfig.from_cfg(cfg.train).resolved(cfg.world_size)
    model = model_config(cfg.model)
    train.validate_model(model)
    checks.check_training_data(train, model)
    return train, model


def local_device(cfg):
    """The device a local run's ranks get (torch decides); None on Slurm, whose compute nodes
    decide."""
    from dtrain.run import dist as ddist

    return ddist.pick_device(cfg.device, 0) if mode_of(cfg) == "local" else None


def check_host(cfg, train: TrainConfig, model, device) -> None:
    """This host's side, after the values: the train config resolved for a local run's ``device``
    (precision `auto`, a CUDA-only context parallelism), a resume's checkpoint and the memory the
    run needs here."""
    from dtrain.run import dist as ddist
    from dtrain.train.checkpoint import check_resume
    from dtrain.train.memory_fit import check_fits

    if device is not None:
        train = train.resolved(cfg.world_size, device.type)
    # every task of a job runs these checks: one reads the whole checkpoint to verify its checksums,
    # the others check sizes only (rank 0's refusal ends the job)
    job = ddist.detect_job(cfg.get("launcher"))
    check_resume(train, checksums=job is None or job.rank == 0)
    if device is not None:
        check_fits(model, train, cfg.world_size, device, f"model.preset={cfg.model.preset}")
