"""The cost model's empirical inputs (``Calibration``), each a ``Param`` that says where it came
from.

``dtrain.costmodel.calibrate`` replaces the datasheet/published defaults below with values measured
in this project's run directories.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .hashing import cached_hash

PROVENANCES = ("datasheet/published:", "measured here:")
# GEMM curve of a device without a kernel table in kernels.yaml (every GPU profile has one; the
# local CPU check replaces it with its gemm-probe's): H100's, the kernels.yaml entry
GPU_E_MAX = 0.82
GPU_W_HALF = 4.8e9
# Share of an overlapped NCCL collective's time that its kernel's SMs do not take from compute (its
# HBM traffic is priced apart, collectives.overlap_cost): fitted to dtrain backtest's development
# set (a test pins it to the fit)
GPU_DP_OVERLAP = 0.9
# Share of TP traffic torchtitan's AsyncTP hides: the development set's with/without-AsyncTP pairs
# (torchtitan performance.md 2024-08 and 2024-12), measured time saved over the TP traffic priced (a
# test pins it to them)
ASYNC_TP_HIDDEN = 0.27


@dataclass(frozen=True)
class Param:
    """A calibrated number and where it came from: 'datasheet/published: …' or 'measured here:
    …'."""

    __hash__ = cached_hash

    value: float
    provenance: str

    def __post_init__(self) -> None:
        if not self.provenance.startswith(PROVENANCES):
            raise ValueError(
                f"provenance must start with one of {PROVENANCES}: {self.provenance!r}"
            )

    @property
    def measured(self) -> bool:
        return self.provenance.startswith("measured here:")


def _published(value: float, source: str) -> Param:
    return Param(value, "datasheet/published: " + source)


def _input(label: str, fmt: str, default):
    """A Calibration field: ``label`` and ``fmt`` (a str.format spec of its value) are how the
    guide's calibration table shows it, so adding a field here adds its row there, its key to
    `dtrain plan --json` and its pick to calibrate (all three read ``fields(Calibration)``)."""
    return field(default_factory=default, metadata={"label": label, "fmt": fmt})


@dataclass(frozen=True)
class Calibration:
    """The empirical inputs of the model; calibration from measured runs replaces each Param."""

    __hash__ = cached_hash

    mfu: Param = _input(
        "GEMM achieved fraction of the roofline bound, large GEMMs (e_max)",
        "{:.1%}",
        lambda: _published(
            GPU_E_MAX,
            "e_max of the GEMM achieved-fraction curve: each GPU's from its GEMM benchmark "
            "(costmodel/kernels.yaml; H100's shown), replaced by a gemm-probe's measured curve",
        ),
    )
    gemm_half_flops: Param = _input(
        "GEMM size reaching half of e_max (W_half)",
        "{:.2g} FLOP",
        lambda: _published(
            GPU_W_HALF,
            "W_half of the GEMM achieved-fraction curve (FLOPs of a GEMM reaching half of e_max): "
            "each GPU's from its GEMM benchmark (costmodel/kernels.yaml; H100's shown)",
        ),
    )
    step_overhead_s: Param = _input(
        "fixed per-step overhead (step minus GEMM time)",
        "{:.4f} s",
        lambda: _published(
            0.0,
            "fixed per-step overhead beyond the modelled terms: none on GPUs, whose memory-bound "
            "kernels and optimizer step are modelled term by term (costmodel/compute.py); the "
            "gemm-probe measures it on the local CPU",
        ),
    )
    dp_overlap: Param = _input(
        "share of overlapped DP/ZeRO traffic hidden (its NCCL kernel's SMs; on GPUs its HBM "
        "traffic is lost apart)",
        "{:.0%}",
        lambda: _published(
            GPU_DP_OVERLAP,
            "share of the DP traffic's time hidden behind the compute it overlaps (DDP bucketing, "
            "Li et al. 2020; FSDP prefetching, Zhao et al. 2023) that its NCCL kernel's SMs leave "
            "to compute (one CTA per channel: NCCL user guide, ncclConfig_t minCTAs/maxCTAs); on "
            "a GPU the ring's HBM traffic, 3 x link bandwidth / HBM bandwidth of the time, is "
            "lost on top (costmodel/collectives.py overlap_cost); fitted to the development set "
            "of dtrain backtest (leave-one-source-out there); fsdp-scaling measures it whole",
        ),
    )
    cp_overlap: Param = _input(
        "share of the CP ring's overlapped K/V sends hidden (as dp_overlap)",
        "{:.0%}",
        lambda: _published(
            GPU_DP_OVERLAP,
            "share of a ring's K/V sends hidden behind the chunk attention they overlap (ring "
            "attention, Liu et al. 2023: the next chunk travels while this one is computed): the "
            "DP overlap's (the same NCCL kernels' SMs, their HBM traffic priced apart on a GPU), "
            "until tp-attention's CP study measures it whole",
        ),
    )
    tp_overhead: Param = _input(
        "TP communication: measured / α–β-modelled time",
        "{:.2f}×",
        lambda: _published(
            1.0,
            "alpha-beta prediction taken as is; Megatron TP collectives are not overlapped "
            "(Shoeybi et al. 2019), tp-attention measures the real/modelled ratio",
        ),
    )
    async_tp_hidden: Param = _input(
        "share of the TP traffic torchtitan's AsyncTP hides",
        "{:.0%}",
        lambda: _published(
            ASYNC_TP_HIDDEN,
            "share of the TP traffic torchtitan's AsyncTP hides: torchtitan docs/performance.md "
            "runs the same layout with and without it twice (2024-08: Llama 3.1 405B, FSDP 16 x "
            "TP 8, Float8, 177 -> 185 tokens/s/GPU; 2024-12 Table 4: Llama 3.1 70B, FSDP 32 x TP "
            "8, Float8, 829 -> 876): the step time saved over the TP all-gathers and "
            "reduce-scatters the model prices for it, 0.34 and 0.28 at link efficiency 0.8 "
            "(dtrain backtest predicts each source's rows with the other source's pair)",
        ),
    )
    pp_overhead: Param = _input(
        "PP bubble: measured p2p wait + idle / bubble formula",
        "{:.2f}×",
        lambda: _published(
            1.0,
            "bubble formula (p-1)*ceil(L/(p*v))/(m*ceil(L/p)) taken as is (Narayanan et al. 2021); "
            "fsdp-scaling's PP layout runs measure the real/formula ratio",
        ),
    )
    fp8_speedup: Param = _input(
        "FP8 compute speed factor over BF16",
        "{:.2f}×",
        lambda: _published(
            1.3,
            "whole-step speed factor of FP8 over BF16, used only on a device without an FP8 GEMM "
            "benchmark (the local check's emulated FP8, where fp8-train measures it); GPUs price "
            "FP8 per GEMM at their FP8 peak and benchmark share, plus the casts "
            "(costmodel/compute.py)",
        ),
    )
    fp8_memory_factor: Param = _input(
        "FP8 activation-memory factor",
        "{:.2f}×",
        lambda: _published(
            1.0,
            "activation bytes factor of an FP8 recipe: 1, the recipes keep their activations in "
            "BF16 (torchao float8 training: torchtitan's Llama 3.1 8B on 8 H100 reported 76.8 GiB "
            "with Float8 and 77.0 without, docs/performance.md 2024-12 Table 1); fp8-train "
            "measures it per recipe",
        ),
    )


def calibration_inputs() -> tuple[str, ...]:
    """The names of Calibration's fields, in order: every list of the model's empirical inputs."""
    return tuple(f.name for f in fields(Calibration))
