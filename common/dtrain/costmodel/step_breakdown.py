"""One step's predicted seconds by part (``StepTime``, what ``timemodel.step_time`` returns) and
the rates they give: tokens/s, model TFLOP/s per GPU, MFU."""

from __future__ import annotations

from dataclasses import dataclass, field

from .compute import ComputeTerms


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on every GPU; ``total`` = the sum of the exposed parts."""

    compute: float
    dp_comm: float
    dp_comm_exposed: float
    tp_comm: float
    pp_comm: float
    bubble: float
    total: float
    tokens: float
    model_flops: float
    gpus: int
    peak_flops: float
    overhead: float = 0.0
    terms: ComputeTerms = field(default_factory=ComputeTerms)
    cp_comm: float = (
        0.0  # context-parallel attention traffic left exposed (ring: behind the attention)
    )
    dp_contention: float = (
        0.0  # of dp_comm_exposed: what the overlapped DP traffic takes from compute (SMs, HBM)
    )
    kernels: int = 0  # kernel launches per step (the eager stack's count, eager.kernel_counts)
    dispatch_floor: float = 0.0  # the host's issue time (eager.host_launches): at least this
    gpu_work: float = 0.0  # eager stacks: the step without that floor (the GPU's work, exposed)
    # of terms.memory: the passes that accumulate gradients outside the GEMMs
    # (TimeModel.grad_accum_s: PyTorch's AccumulateGrad, DeepSpeed's BF16_Optimizer copy)
    grad_accum: float = 0.0
    fsdp_copy_out: float = 0.0  # of terms.memory: FSDP2's all-gather copy-outs (fsdp2_copy_out_s)

    @property
    def launch_bound(self) -> bool:
        """The host issuing kernels, not the GPU, sets the step (eager stacks)."""
        return self.dispatch_floor > 0 and self.dispatch_floor >= self.total

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved model TFLOP/s per GPU (model FLOPs: recompute not counted)."""
        return self.model_flops / (self.total * self.gpus) / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs (``model_flops_per_token``, no recompute) / (time · GPUs · BF16 dense
        peak)."""
        return self.model_flops / (self.total * self.gpus * self.peak_flops)
