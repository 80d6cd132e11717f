"""What `python -m allreduce_bench` refuses before any rank starts (dtrain.run.app runs ``validate``
for every point of a sweep). The sweep's values first, without torch (allreduce_bench.spec); then
the backend the ranks
will use, which needs torch on a local run, against the dtypes and reductions it is known to
refuse."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from allreduce_bench import spec
from dtrain.core.errors import UserError
from dtrain.run import dist as ddist
from dtrain.run.launch import mode_of


def expected_backend(cfg: DictConfig) -> str | None:
    """The backend the ranks will use, when it can be known before they start."""
    if mode_of(cfg) == "slurm":
        return (
            cfg.backend
            if cfg.backend != "auto"
            else ("nccl" if cfg.slurm.gpus_per_node else "gloo")
        )
    return ddist.pick_backend(
        cfg.backend, ddist.pick_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
    )


def validate(cfg: DictConfig) -> None:
    s = spec.parse(cfg)
    backend = expected_backend(cfg)
    for dtype in s.dtypes:
        problem = spec.known_unsupported(backend, dtype, s.redop, s.collectives)
        if problem:
            raise UserError(problem)
