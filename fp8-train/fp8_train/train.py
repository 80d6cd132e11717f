"""One training run: the shared dtrain Trainer with this subproject's numerics and callbacks.

validate(cfg)   every key checked before a rank starts (bad input = one line, exit 2)
rank_fn(ctx)    numerics (backends.py) + precision map -> Trainer(callbacks=[faults, guard,
                debug tool, health]) -> run
finalize(...)   table, steps.csv, dashboard, and the summary whose "guide_inputs" the cost model
                reads
"""

from __future__ import annotations

import dataclasses
import statistics
import textwrap
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dtrain.core import nodes as dtrain_config
from dtrain.costmodel import hardware
from dtrain.model.args import model_dict
from dtrain.results import contract_records, trainer_inputs
from dtrain.results.loader import read_jsonl
from dtrain.results.metrics import RECORDS
from dtrain.train import Trainer, TrainConfig
from fp8_train import backends, faults, recipes, scaling
from fp8_train.debug import DebugTool
from fp8_train.guard import NanGuard
from fp8_train.health import HealthMonitor
from fp8_train.precision_map import PrecisionMap

STEP_TOOLS = (
    "guard",
    "health",
    "fp8_debug",
)  # per-step callbacks published as step_callbacks (not modelled)
FINAL_WINDOW = 5  # final loss = mean over the last 5 steps (one batch is a noisy estimate)


def model_config(cfg: DictConfig):
    """The `model:` node (preset + GPTConfig fields) as a GPTConfig."""
    return dtrain_config.model_config(cfg.model)


def rank_fn(ctx) -> dict:
    cfg = ctx.cfg
    model_cfg = model_config(cfg)
    numerics = backends.build(cfg.recipe, cfg.train.precision, cfg.fp8, ctx.device)
    pmap = PrecisionMap.from_cfg(
        cfg.precision_map, model_cfg, multiple=recipes.shape_multiple(cfg.recipe)
    )
    factory = pmap.factory(numerics.fp8_linear) if numerics.fp8_linear else None
    # the recipe decides the Trainer's precision (fp16 trains as fp32 under autocast); config.yaml
    # keeps train.precision
    train = dataclasses.replace(TrainConfig.from_cfg(cfg.train), precision=numerics.train_precision)
    guard = NanGuard(cfg.guard) if cfg.guard.enabled else None
    callbacks = [
        faults.FaultInjector(OmegaConf.to_container(cfg.faults, resolve=True), ctx.rank),
        guard,
        DebugTool(cfg.fp8_debug, ctx.run_dir, ctx.rank),
        HealthMonitor(cfg.health, ctx.rank, ctx.run_dir) if cfg.health.enabled else None,
    ]
    # fp16 trains as "fp32" to the Trainer (autocast does the casting): its GPU peak is the fp16 one
    fp16_gpu = numerics.precision == "fp16" and ctx.device.type == "cuda"
    peak = hardware.peak_flops(ctx.device, "fp16") if fp16_gpu else None
    trainer = Trainer(
        ctx,
        train,
        model_cfg,
        linear_factory=factory,
        autocast=numerics.autocast,
        grad_scaler=numerics.grad_scaler,
        callbacks=[c for c in callbacks if c is not None],
        peak_flops=peak,
    )
    if (
        ctx.world_size > 1
    ):  # first at each step's end: the guard's checkpoints then hold the reduced state
        trainer.callbacks.insert(
            0, scaling.AmaxReduction(trainer.model, dist.new_group(backend=ctx.backend))
        )
    decisions = pmap.all_decisions() if factory else []
    if ctx.is_main:
        for d in decisions:
            ctx.writer.record(
                "layer_precision", layer=d.name, precision=d.precision, reason=d.reason
            )
        for d in pmap.fallbacks():
            ctx.writer.event("layer_fallback", layer=d.name, reason=d.reason)
    result = trainer.run()
    high = (pmap.high_precision_layers() if factory else []) + (guard.switched if guard else [])
    return {
        **result,
        "recipe": cfg.recipe,
        "fp8_backend": numerics.backend,
        "precision": numerics.precision,
        "nan_events": guard.nan_events if guard else 0,
        "rollbacks": guard.rollbacks if guard else 0,
        "high_precision_layers": high,
        "switched_to_high_precision": guard.switched if guard else [],
        "notes": numerics.notes,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "gpu_name": ctx.gpu_name,
        "model": model_dict(model_cfg),
        "train": trainer.train.to_dict(),
    }


def step_rows(run_dir: Path) -> list[dict]:
    """The step records, the last attempt of each step (a rollback re-runs steps)."""
    rows = [r for r in read_jsonl(Path(run_dir) / RECORDS) if r.get("kind") == "step"]
    return list({r["step"]: r for r in rows}.values())


def final_loss(rows: list[dict]) -> float | None:
    losses = [r["loss"] for r in rows if r.get("loss") is not None][-FINAL_WINDOW:]
    return statistics.fmean(losses) if losses else None


def finalize(run_dir: Path, cfg: DictConfig, result: dict) -> dict:
    from rich import box
    from rich.table import Table

    import pandas as pd

    from dtrain.core.terminal import WIDTH, console
    from fp8_train import dashboard

    rows = step_rows(run_dir)
    pd.DataFrame(rows).to_csv(run_dir / "steps.csv", index=False)
    loss = final_loss(rows)
    # the recipe is in the title; short headers keep the table within 100 columns
    # (dtrain.core.terminal)
    table = Table(
        title=f"fp8-train {cfg.recipe} ({result['device']}, {cfg.world_size} ranks, "
        f"{cfg.train.strategy})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("precision", "final loss", "tokens/s", "peak mem", "NaN events", "rollbacks"):
        table.add_column(col, justify="right")
    table.add_column("kept in high precision")
    table.add_row(
        result["precision"],
        f"{loss:.4f}" if loss is not None else "-",
        f"{result['tokens_per_s']:.0f}",
        f"{result['peak_mem_bytes'] / 2**20:.0f} MiB",
        str(result["nan_events"]),
        str(result["rollbacks"]),
        ", ".join(result["high_precision_layers"]) or "-",
    )
    console().print(table)  # within 100 columns: a long layer list wraps by words
    for note in result.get("notes", []):
        print(textwrap.fill(f"note: {note}", WIDTH, subsequent_indent="  ", break_on_hyphens=False))
    dashboard.render([run_dir], run_dir)
    where = contract_records.where_of(result["device"], result["backend"], result["gpu_name"])
    layout = TrainConfig(**result.pop("train")).layout(result["world_size"], where.device)
    inputs = trainer_inputs.training_inputs(
        result,
        result.pop("model"),
        layout,
        where,
        precision=result["precision"],
        recipe=cfg.recipe,
        step_callbacks=[k for k in STEP_TOOLS if cfg[k].enabled],
    )
    return {
        **result,
        "final_loss": loss,
        "final_loss_last_step": result.get("final_loss"),
        "guide_inputs": inputs,
    }
