"""Fault injection by config, so every rung of the recovery ladder can be exercised on purpose.

    faults:
      - {step: 12, layer: blocks.1.mlp.w1, tensor: activation, kind: inf, rank: 0, repeat: 1}

kind: inf | nan (one element of the tensor set to it) | huge (the tensor times `factor`, default
1e4: finite, but far past what the FP8 scales expect). tensor: activation (the layer's output in
forward) | gradient (the gradient arriving at that output in backward). The fault fires on the
first `repeat` step attempts at or after `step` (steps re-run after a rollback count as attempts,
so a fault never fires forever) on rank `rank` (null = every rank).
"""

from __future__ import annotations

import torch

from dtrain.core.checks import one_of
from dtrain.core.errors import UserError
from dtrain.train import Callback
from dtrain.train.parallelize import unwrap

KINDS = ("inf", "nan", "huge")
TENSORS = ("activation", "gradient")


def kind_of(fault: dict) -> str:
    """YAML reads a bare `inf` / `nan` as a float; both spellings mean the same fault."""
    return str(fault.get("kind", "inf")).lower()


def check(faults, module_names: set[str]) -> None:
    for i, f in enumerate(faults or []):
        where = f"faults[{i}]"
        for key in ("step", "layer"):
            if key not in f:
                raise UserError(
                    f"{where} needs '{key}': e.g. {{step: 10, layer: blocks.0.mlp.w1, kind: inf}}"
                )
        if kind_of(f) not in KINDS:
            one_of(f"{where}.kind", f["kind"], KINDS)
        one_of(f"{where}.tensor", f.get("tensor", "activation"), TENSORS)
        if f["layer"] not in module_names:
            raise UserError(
                f"{where}.layer={f['layer']!r} is not a module of the model: "
                f"e.g. {', '.join(sorted(n for n in module_names if n.endswith('w1')))}"
            )


def corrupt(t: torch.Tensor, kind: str, factor: float) -> torch.Tensor:
    if kind == "huge":
        return t * factor
    t = t.clone()
    t.view(-1)[0] = float("inf") if kind == "inf" else float("nan")
    return t


class FaultInjector(Callback):
    def __init__(self, faults, rank: int):
        self.faults = [
            dict(
                step=int(f["step"]),
                layer=str(f["layer"]),
                tensor=f.get("tensor", "activation"),
                kind=kind_of(f),
                rank=f.get("rank", 0),
                repeat=int(f.get("repeat", 1)),
                factor=float(f.get("factor", 1e4)),
                fired=0,
            )
            for f in (faults or [])
        ]
        self.rank = rank
        self.active: list[dict] = []

    def on_train_start(self, trainer) -> None:
        model = unwrap(trainer.model)
        for f in self.faults:
            model.get_submodule(f["layer"]).register_forward_hook(self._hook(f))

    def on_step_start(self, trainer, step: int) -> None:
        self.active = []
        for f in self.faults:
            if step >= f["step"] and f["fired"] < f["repeat"]:
                f["fired"] += 1  # counted on every rank, so all ranks agree on when it is spent
                if f["rank"] is None or f["rank"] == self.rank:
                    self.active.append(f)
                    trainer.ctx.writer.event(
                        "fault_injected",
                        step=step,
                        layer=f["layer"],
                        tensor=f["tensor"],
                        fault=f["kind"],
                        attempt=f["fired"],
                    )

    def _hook(self, fault: dict):
        def hook(module, inputs, output):
            if fault not in self.active or not torch.is_grad_enabled():
                return None
            if fault["tensor"] == "activation":
                return corrupt(output, fault["kind"], fault["factor"])
            if output.requires_grad:
                output.register_hook(lambda g: corrupt(g, fault["kind"], fault["factor"]))
            return None

        return hook
