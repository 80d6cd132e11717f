"""DP x TP x PP in the shared trainer: 5-step losses equal the single-process run (fp32, gloo),
checkpoints resume exactly on the same and on another layout, bad layouts are one-line errors.

Several trainings run inside one launch (each spawn costs seconds); the model is the tiny GPT
with 4 layers (so 2 ranks x 2 virtual stages fit), global batch 4 = 4 micro-batches of 1."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dtrain.errors import UserError
from dtrain.launch import launch
from dtrain.model import GPTConfig
from dtrain.train import Callback, Trainer, TrainConfig

STEPS = 5
MODEL = GPTConfig.from_preset("tiny", n_layer=4)


def base_cfg(world_size: int, **extra):
    return OmegaConf.create({"launcher": "local", "world_size": world_size, "backend": "gloo", "device": "cpu",
                             "seed": 0, "dist_timeout_s": 300, "threads_per_rank": 1, "subproject": "test", **extra})


def train_of(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": STEPS, "micro_batch": 1, "global_batch": 4, "log_every": 0,
                          "dataset_tokens": 20_000, "timing_warmup": 0, "strategy": "zero3", **kw})


class Losses(Callback):
    def __init__(self):
        self.losses, self.grad_norms = [], []

    def on_step_end(self, trainer, step, metrics):
        self.losses.append(metrics["loss"])
        self.grad_norms.append(metrics["grad_norm"])


def many_layouts(ctx) -> dict:
    """Every layout in ctx.cfg.specs in turn: its per-step losses, grad norms, last checkpoint."""
    out = {}
    for name, spec in ctx.cfg.specs.items():
        seen = Losses()
        trainer = Trainer(ctx, train_of(**OmegaConf.to_container(spec)), MODEL, callbacks=[seen])
        trainer.run()
        out[name] = {"losses": seen.losses, "grad_norms": seen.grad_norms, "checkpoint": trainer.last_checkpoint}
    return out


def run_specs(tmp_path, world_size: int, specs: dict) -> dict:
    run_dir = tmp_path / f"ws{world_size}-{'-'.join(specs)}"
    run_dir.mkdir()
    return launch(many_layouts, base_cfg(world_size, specs=specs), run_dir)[0]
