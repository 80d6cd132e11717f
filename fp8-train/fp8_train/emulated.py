"""The project's own FP8 Linear: per-tensor fake quantization, runs anywhere (CPU included).

Forward: input and weight are rounded through E4M3 (each with its own scale), the matmul runs in
the high-precision dtype on the rounded values. Backward: the output gradient is rounded through
E5M2; dgrad = g8 @ w8 and wgrad = g8^T @ x8 use the FP8-rounded operands, as TE's FP8 GEMMs do.
Bias and its gradient stay high precision.

Scaling is delayed (amax history + margin; the only delayed-scaling implementation that runs on
CPU) or current. The three scalers are submodules, so their amax histories and scales are part of
the model's state dict and of every checkpoint. `fp8_enabled = False` turns the layer into a plain
high-precision Linear at run time (the recovery ladder's last rung).

Dtypes, as TE's te.Linear: the compute dtype is torch autocast's dtype when autocast is on for the
input's device, else the input's dtype (bf16 under FSDP2's MixedPrecisionPolicy, which hands the
layer bf16 weights and inputs). Both operands are cast to it before quantization; the round trip
itself is computed in fp32 (as TE's cast kernels do) and its result is in the compute dtype. The
matmuls run with autocast off, in the compute dtype; backward returns each gradient in the dtype of
its input (fp32 master weights get fp32 grads, FSDP2's bf16 weights get bf16 grads).

Activation checkpointing: a block's forward runs again inside backward. The recomputation must
see the same FP8 operands as the first forward, so a forward that runs inside a backward pass
reuses the scales the first forward used and records no amax (TE's
`in_fp8_activation_recompute_phase`).

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
SCALINGS = (
    "delayed",
    "current",
    "nvfp4",
    "mxfp4",
)  # the last two: FP4 block scaling, no scale state


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls of this call run in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def in_recompute() -> bool:
    """True while a forward runs inside a backward pass: activation checkpointing's
    recomputation."""
    return torch._C._current_graph_task_id() != -1


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer: "FP8Linear"):
        dtype, replay = compute_dtype(x), in_recompute()
        x8 = layer.quant("input", x.to(dtype), replay=replay)
        w8 = layer.quant("weight", weight.to(dtype), replay=replay)
        ctx.save_for_backward(x8, w8)
        ctx.layer, ctx.has_bias = layer, bias is not None
        ctx.grad_dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x8, w8, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out):
        x8, w8 = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.grad_dtypes
        with torch.autocast(grad_out.device.type, enabled=False):
            g8 = ctx.layer.quant("grad_output", grad_out.to(x8.dtype))
            grad_x = (g8 @ w8).to(x_dtype)
            grad_w = (g8.reshape(-1, g8.shape[-1]).t() @ x8.reshape(-1, x8.shape[-1])).to(w_dtype)
            grad_b = (
                grad_out.reshape(-1, grad_out.shape[-1]).float().sum(0).to(b_dtype)
                if ctx.has_bias
                else None
            )
        return grad_x, grad_w, grad_b, None


class FP8Linear(nn.Linear):
    """nn.Linear whose matmuls see E4M3 input/weight and E5M2 output gradients."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        scaling: str = "delayed",
        margin: int = 0,
        history_len: int = 16,
        amax_algo: str = "max",
        fwd_format: Format = E4M3,
        bwd_format: Format = E5M2,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {scaling!r}: choose one of {SCALINGS}")
        self.scaling, self.fwd_format, self.bwd_format = scaling, fwd_format, bwd_format
        self.fp8_enabled = True
        self._last_scale: dict[str, torch.Tensor] = {}  # per role, for activation recomputation
        self.block_recipe = scaling if scaling in fp4.BLOCK_RECIPES else None
        if self.block_recipe is None:
            kw = dict(margin=margin, history_len=history_len, algo=amax_algo)
            self.input_scaler = make_scaler(scaling, fwd_format, **kw)
            self.weight_scaler = make_scaler(scaling, fwd_format, **kw)
            self.grad_output_scaler = make_scaler(scaling, bwd_format, **kw)

    def quant(self, role: str, t: torch.Tensor, replay: bool = False) -> torch.Tensor:
        """The round trip one operand takes: per-tensor scaled FP8, or block-scaled FP4; computed in
        fp32, returned in t's dtype. replay=True (recomputation) reuses this role's last scale and
        leaves the scaler's state alone."""
        if self.block_recipe is not None:
            return fp4.quantize(t, self.block_recipe)  # stateless: a recomputation rounds the same
        fmt = self.bwd_format if role == "grad_output" else self.fwd_format
        if replay and role in self._last_scale:
            scale = self._last_scale[role]
        else:
            scale = self._last_scale[role] = getattr(self, _attr(role)).scale_for(t)
        return quantize(t.float(), scale.float(), fmt).to(t.dtype)

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
    return {
        "input": "input_scaler",
        "weight": "weight_scaler",
        "grad_output": "grad_output_scaler",
    }[role]


def fp8_layers(model: nn.Module) -> dict[str, FP8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
