"""The rates one step runs at on a GPU (``Device``: the peaks, HBM bandwidth, the kernel table,
the power scale and the stack's kernel choices) and how a cluster, calibration and stack give
them (``device_of``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .calibration import Calibration, Param
from .efficiency import Gemm, GemmCurve, gemm_time
from .hardware import Cluster, GPUProfile
from .hashing import cached_hash
from .kernel_rates import KernelModel, published
from .stack import Stack


@dataclass(frozen=True)
class Device:
    """The rates one step runs at: peaks, the kernel model, HBM bandwidth, the power scale."""

    __hash__ = cached_hash

    peak_bf16: float
    peak_fp8: float | None
    hbm_Bps: float
    kernels: KernelModel
    power_scale: float = (
        1.0  # time multiplier of compute-bound kernels: sustained clocks, a lower power cap
    )
    fused: bool = True
    fused_loss: bool = True
    fp8_scaling: str = "delayed"  # Stack.fp8_casts: the FP8 casts' cost (FP8_CAST_BYTES)
    fp8_weight_gather: bool = (
        False  # FSDP gathers the block linears' weights in FP8 (Stack.fp8_all_gather tp+fsdp)
    )
    optimizer: str | None = None  # Stack.optimizer: the AdamW the stack names (None: as kernels)
    bf16_params_sharded: bool = False  # Stack.bf16_params_sharded: bf16 compute under FSDP

    def gemm_s(self, g: Gemm, dtype: str = "bf16", value_bytes: int = 2) -> float:
        curve = self.kernels.gemm.get(dtype) or self.kernels.gemm["bf16"]
        peak = self.peak_fp8 if dtype == "fp8" and self.peak_fp8 else self.peak_bf16
        scale = self.power_scale * (
            self.kernels.sustained if self.kernels.gemm_measured and dtype != "fp8" else 1.0
        )
        return gemm_time(g, peak, self.hbm_Bps, curve, value_bytes) * scale

    def mem_s(self, nbytes: float, kind: str, width: float | None = None) -> float:
        """Seconds to move ``nbytes`` in kernels of ``kind`` walking rows of ``width`` elements
        (None: the kind's median share over the measured widths)."""
        if self.kernels.memory is None:
            return 0.0
        return nbytes / (self.hbm_Bps * self.kernels.memory_share(kind, width))


def device_of(cluster: Cluster, calib: Calibration, stack: Stack = Stack()) -> Device:
    """The rates a step runs at on ``cluster``'s GPU: its published kernel table
    (``kernels.yaml``), the GEMM curve replaced by a measured one (``calib.mfu`` measured: the
    gemm-probe), or, for a device without a table (the local CPU check), a GEMM-only model on the
    calibrated curve."""
    return _device(cluster.gpu, calib.mfu, calib.gemm_half_flops, stack)


@lru_cache(maxsize=256)
def _device(gpu: GPUProfile, mfu: Param, gemm_half_flops: Param, stack: Stack) -> Device:
    calib = Calibration(mfu=mfu, gemm_half_flops=gemm_half_flops)
    curve = GemmCurve(calib.mfu.value, calib.gemm_half_flops.value)
    kernels = published(gpu.name, stack.attention)
    if kernels is None:
        kernels = KernelModel(gpu.name, {"bf16": curve})
    elif calib.mfu.measured:
        kernels = kernels.with_gemm("bf16", curve, calib.mfu.provenance)
    scale = kernels.power_scale(gpu.power_w) / kernels.sustained
    return Device(
        gpu.peak_bf16_flops,
        gpu.peak_fp8_flops,
        gpu.hbm_tbps * 1e12,
        kernels,
        scale,
        stack.fused,
        stack.fused_loss,
        stack.fp8_casts,
        stack.fp8_gathers("fp8")[1],
        stack.optimizer,
        stack.bf16_params_sharded,
    )
