"""The software a layout runs on, as far as it moves the cost (``Stack``): the attention kernel,
fused or eager kernels and loss, how TP traffic overlaps, which all-gathers an FP8 run moves in
FP8, and the dtypes of the gradients and the optimizer states. A published run states it;
``dtrain plan`` takes it as flags."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.core.checks import one_of

from .hashing import cached_hash
from .software import Software, software

# the GPU's best fused attention (FlashAttention-2 on Ampere, cuDNN / FlashAttention-3 class on
# Hopper), the FlashAttention-2 class on any GPU, and eager attention over stored scores
ATTENTION_KERNELS = ("flash", "flash2", "eager")
FP8_ALL_GATHERS = ("none", "tp", "tp+fsdp")  # see Stack.fp8_all_gather
STATE_DTYPES = ("fp32", "bf16")  # see Stack.grad_reduce, Stack.optimizer_states
DP_SYNCS = ("overlap", "flush")  # see Stack.dp_sync
FP8_SCALINGS = ("delayed", "dynamic", "eager")  # see Stack.fp8_scaling
DYNAMIC_FP8_SOFTWARE = ("torchtitan", "dtrain")  # torchao's float8 training: dynamic scales only
EAGER_FP8_SOFTWARE = ("fsdp-eager",)  # the same without compile: its casts run op by op
OPTIMIZERS = ("foreach", "fused")  # see Stack.optimizer
# the eager stack and dtrain's own trainer: bf16 under autocast without FSDP, and in FSDP2's bf16
# parameters without autocast under it (ZeRO-2/3; dtrain.train.trainer._default_autocast).
# torchtitan runs FSDP2 that way too, but its Llama block is not the block counted for it
# (memory_bound.BF16_PARAMS_BYTES): its eager ops (RMSNorm's fp32 upcast written out, complex RoPE)
# keep EAGER_BYTES; with the count's share its eager 8B rows would go from +6%/+10% to +20%/+23%
TRAINER_SOFTWARE = ("fsdp-eager", "dtrain")


@dataclass(frozen=True)
class Stack:
    """The software a layout runs on, as far as it moves the cost: the attention kernel
    (ATTENTION_KERNELS), fused or eager norm / activation / cast kernels (Megatron's fused kernels,
    torch.compile; or PyTorch without compile), and a fused vocab-parallel cross-entropy or
    PyTorch's unfused one (default: as the kernels; torchtitan compiles its blocks but not its
    loss); ``tp_overlap``: TP collectives run overlapped with the GEMMs they feed
    (TransformerEngine's userbuffers, Megatron ``--tp-comm-overlap``); ``async_tp``: torchtitan's
    AsyncTP (PyTorch's symmetric-memory micro-pipelining of the TP all-gathers and reduce-scatters
    with their matmuls), which hides its own measured share (``Calibration.async_tp_hidden``);
    ``fp8_all_gather``: which all-gathers of an FP8 run move 1-byte values (FP8_ALL_GATHERS): "tp",
    the sequence-parallel all-gathers of a linear's input (forward) and output gradient (backward),
    cast before the gather (torchao's Float8 Colwise/RowwiseParallel, which torchtitan applies
    whenever Float8 and TP are on; TransformerEngine's LayerNormLinear and grad_output_preprocess),
    the reduce-scatters staying bf16; "tp+fsdp", also the FSDP / ZeRO weight all-gathers of the
    linears (torchao ``enable_fsdp_float8_all_gather``, Megatron ``--fp8-param-gather``); "none",
    neither (dtrain's own trainer: its TP plan has no Float8 styles yet). Default "tp", what both
    FP8 stacks of the field do unasked. ``grad_reduce`` (STATE_DTYPES): the dtype gradients
    accumulate and reduce in over DP, "fp32" (default: Megatron's for bf16, torchtitan's
    ``mixed_precision_reduce``, dtrain's) or "bf16" (apex DistributedFusedAdam's
    ``grad_sync_dtype``, torchtitan ``mixed_precision_reduce=bfloat16``); ``optimizer_states``:
    "fp32" (default: fp32 master weights, Adam moments) or "bf16" (Adam moments in bf16 and no fp32
    master copy: apex DistributedFusedAdam with ``dtype`` the model's bf16, which NeMo then runs
    with ``store_params=False``), see ``model_states.model_state_bytes``. ``dp_sync``
    (DP_SYNCS): when the once-per-step DP collectives run (ZeRO-0/1; ZeRO-3 under PP gathers its
    weights once too):
    "overlap" (default; Megatron's ``--overlap-grad-reduce`` / ``--overlap-param-gather``: the
    gradients behind the last micro-batch's backward, the weights behind the first forward) or
    "flush" (DeepSpeed's pipeline engine: its TrainSchedule issues ReduceTiedGrads, ReduceGrads and
    OptimizerStep after the pipeline's last step, and ZeRO-1 all-gathers the updated weights inside
    the optimizer step: nothing hidden). ``software``: the framework, which decides which layouts
    exist, which TP overlaps it has (``Software.tp_overlaps``: ``tp_overlap`` and ``async_tp`` are
    refused elsewhere) and whose pipeline engine runs them (``Software.pipeline_engine``)
    (``software.SOFTWARE``; default "any": every layout). ``fp8_scaling``
    (FP8_SCALINGS): how an FP8 run scales its casts, which sets what they cost
    (``memory_bound.FP8_CAST_BYTES``):
    "dynamic", a global amax of each tensor before its cast (torchao's float8 training,
    torchtitan's and dtrain's), "eager", the same run op by op without compile (the fsdp-eager
    stack's), or "delayed", the scale from an amax history with the cast fused
    into the kernel that produces the tensor (TransformerEngine's recipe, Megatron's); default
    (None) the software's own. ``optimizer`` (OPTIMIZERS): which AdamW runs, "foreach" (PyTorch's
    default) or "fused" (``fused=True``), priced by ``compute.optimizer_s``; None: as the kernels
    (fused kernels with fused AdamW, eager ones with foreach), the rate every row had before the
    field. ``eager.STACK_DEFAULTS``: what ``--software fsdp-eager`` sets unless told otherwise."""

    __hash__ = cached_hash

    attention: str = "flash"
    kernels: str = "fused"
    loss: str | None = None
    tp_overlap: bool = False
    async_tp: bool = False
    fp8_all_gather: str = "tp"
    grad_reduce: str = "fp32"
    optimizer_states: str = "fp32"
    dp_sync: str = "overlap"
    software: str = "any"
    fp8_scaling: str | None = None
    optimizer: str | None = None

    def __post_init__(self) -> None:
        software(self.software)  # raises for an unknown name
        one_of("optimizer", self.optimizer, (*OPTIMIZERS, None), error=ValueError)
        one_of("fp8_scaling", self.fp8_scaling, (*FP8_SCALINGS, None), error=ValueError)
        one_of("dp_sync", self.dp_sync, DP_SYNCS, error=ValueError)
        for name in ("grad_reduce", "optimizer_states"):
            one_of(name, getattr(self, name), STATE_DTYPES, error=ValueError)
        one_of("fp8_all_gather", self.fp8_all_gather, FP8_ALL_GATHERS, error=ValueError)
        one_of("attention", self.attention, ATTENTION_KERNELS, error=ValueError)
        one_of("kernels", self.kernels, ("fused", "eager"), error=ValueError)
        one_of("loss", self.loss, ("fused", "eager", None), error=ValueError)  # None: as kernels
        if self.tp_overlap and self.async_tp:
            raise ValueError(
                "tp_overlap (TransformerEngine's) and async_tp (torchtitan's) are two stacks: "
                "give one"
            )
        for flag, kind in (("tp_overlap", "te"), ("async_tp", "async")):
            if getattr(self, flag) and kind not in self.runs.tp_overlaps:
                runs = ", ".join(self.runs.tp_overlaps) or "none"
                raise ValueError(f"{self.software} has no {flag} (its TP overlaps: {runs})")

    @property
    def fused(self) -> bool:
        return self.kernels == "fused"

    @property
    def fused_loss(self) -> bool:
        return (self.loss or self.kernels) == "fused"

    @property
    def fp8_casts(self) -> str:
        """The FP8 scaling this stack's casts run (FP8_SCALINGS): the one given, else the
        software's."""
        if self.fp8_scaling:
            return self.fp8_scaling
        if self.software in EAGER_FP8_SOFTWARE:
            return "eager"
        return "dynamic" if self.software in DYNAMIC_FP8_SOFTWARE else "delayed"

    @property
    def bf16_params_sharded(self) -> bool:
        """Under FSDP (ZeRO-2/3) the blocks compute in bf16 parameters without autocast
        (``memory_bound.BF16_PARAMS_BYTES``): dtrain's trainer and the eager stack."""
        return self.software in TRAINER_SOFTWARE

    @property
    def runs(self) -> Software:
        """The layouts this stack's framework runs."""
        return software(self.software)

    @property
    def flash(self) -> bool:
        return self.attention != "eager"

    def describe(self) -> str:
        loss = f", {self.loss} loss" if self.loss and self.loss != self.kernels else ""
        tp = ", TP overlapped" if self.tp_overlap else ", AsyncTP" if self.async_tp else ""
        gathers = f", FP8 all-gathers: {self.fp8_all_gather}" if self.fp8_all_gather != "tp" else ""
        states = "".join(
            f", {what} {dtype}"
            for what, dtype in (
                ("gradients", self.grad_reduce),
                ("optimizer states", self.optimizer_states),
            )
            if dtype != "fp32"
        )
        flush = ", DP sync at the pipeline flush" if self.dp_sync == "flush" else ""
        flush += f", FP8 {self.fp8_scaling} scaling" if self.fp8_scaling else ""
        flush += f", {self.optimizer} AdamW" if self.optimizer else ""
        sw = f"{self.software}: " if self.software != "any" else ""
        return (
            f"{sw}{self.attention} attention, {self.kernels} "
            f"kernels{loss}{tp}{gathers}{states}{flush}"
        )

    @property
    def grad_bytes(self) -> int:
        """Bytes of one gradient value as it accumulates and crosses DP (``grad_reduce``)."""
        return 4 if self.grad_reduce == "fp32" else 2

    def fp8_gathers(self, precision: str) -> tuple[bool, bool]:
        """(TP all-gathers, FSDP weight all-gathers) in FP8 for a run in ``precision`` (bf16
        runs: neither)."""
        fp8 = precision == "fp8"
        return fp8 and self.fp8_all_gather != "none", fp8 and self.fp8_all_gather == "tp+fsdp"
