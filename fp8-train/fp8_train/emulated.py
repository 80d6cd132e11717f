"""The project's own FP8 Linear: per-tensor fake quantization, runs anywhere (CPU included).

Forward: input and weight are rounded through E4M3 (each with its own scale), the matmul runs in
the high-precision dtype on the rounded values. Backward: the output gradient is rounded through
E5M2; dgrad = g8 @ w8 and wgrad = g8^T @ x8 use the FP8-rounded operands, as TE's FP8 GEMMs do.
Bias and its gradient stay high precision.

Scaling is delayed (amax history + margin; the only delayed-scaling implementation that runs on
CPU) or current. The three scalers are submodules, so their amax histories and scales are part of
the model's state dict and of every checkpoint. `fp8_enabled = False` turns the layer into a plain
high-precision Linear at run time (the recovery ladder's last rung).

Difference from TE: amaxes are per rank (TE all-reduces them over the data-parallel group); with
DDP or FSDP the weight amax is the same on every rank anyway.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_train import fp4
from fp8_train.formats import E4M3, E5M2, Format, quantize
from fp8_train.scaling import make_scaler

ROLES = ("input", "weight", "grad_output")
SCALINGS = ("delayed", "current", "nvfp4", "mxfp4")  # the last two: FP4 block scaling, no scale state


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer: "FP8Linear"):
        x8 = layer.quant("input", x)
        w8 = layer.quant("weight", weight.to(x.dtype))
        ctx.save_for_backward(x8, w8)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.linear(x8, w8, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        x8, w8 = ctx.saved_tensors
        layer = ctx.layer
        g8 = layer.quant("grad_output", grad_out)
        grad_x = g8 @ w8
        grad_w = g8.reshape(-1, g8.shape[-1]).t() @ x8.reshape(-1, x8.shape[-1])
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class FP8Linear(nn.Linear):
    """nn.Linear whose matmuls see E4M3 input/weight and E5M2 output gradients."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, scaling: str = "delayed",
                 margin: int = 0, history_len: int = 16, amax_algo: str = "max",
                 fwd_format: Format = E4M3, bwd_format: Format = E5M2, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {scaling!r}: choose one of {SCALINGS}")
        self.scaling, self.fwd_format, self.bwd_format = scaling, fwd_format, bwd_format
        self.fp8_enabled = True
        self.block_recipe = scaling if scaling in fp4.BLOCK_RECIPES else None
        if self.block_recipe is None:
            kw = dict(margin=margin, history_len=history_len, algo=amax_algo)
            self.input_scaler = make_scaler(scaling, fwd_format, **kw)
            self.weight_scaler = make_scaler(scaling, fwd_format, **kw)
            self.grad_scaler = make_scaler(scaling, bwd_format, **kw)

    def quant(self, role: str, t: torch.Tensor) -> torch.Tensor:
        """The round trip one operand takes: per-tensor scaled FP8, or block-scaled FP4."""
        if self.block_recipe is not None:
            return fp4.quantize(t, self.block_recipe)
        fmt = self.bwd_format if role == "grad_output" else self.fwd_format
        scaler = getattr(self, _attr(role))
        return quantize(t, scaler.scale_for(t).to(t.dtype), fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return super().forward(x)
        return _FP8LinearFn.apply(x, self.weight, self.bias, self)

    def scales(self) -> dict[str, float]:
        """Current scale factor per role, for dashboards and NaN events."""
        if self.block_recipe is not None:
            return {}
        return {role: float(getattr(self, _attr(role)).scale) for role in ROLES}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_enabled}, scaling={self.scaling}"


def _attr(role: str) -> str:
    return {"input": "input_scaler", "weight": "weight_scaler", "grad_output": "grad_scaler"}[role]


def fp8_layers(model: nn.Module) -> dict[str, FP8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
