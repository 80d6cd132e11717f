"""GPU profiles (from ``hardware.yaml``), the peak of the device a run is on (``peak_flops``: the
datasheet figure matched by CUDA device name, or the CPU matmul probe), link models and the
cluster a plan runs on.

Every number in ``hardware.yaml`` is a datasheet figure with its ``source``; units are documented
at the top of that file. The cost model uses *dense* tensor-core peaks (no 2:4 sparsity) and the
NVLink bandwidth *per direction* (H100: 450 GB/s of the datasheet's 900 GB/s total), because that
is the figure nccl-tests' bus bandwidth is comparable with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml
from .hashing import cached_hash

GiB = 1024**3
_FIELDS = (
    "bf16_tflops",
    "fp8_tflops",
    "hbm_gib",
    "hbm_tbps",
    "nvlink_gbps_per_dir",
    "nvlink_gbps_bidir",
    "nvlink_domain",
    "pcie_gen",
    "pcie_gbps_per_dir",
    "ib_gbit_per_gpu",
    "source",
)


@dataclass(frozen=True)
class GPUProfile:
    """One GPU model as printed on its datasheet (units as in ``hardware.yaml``)."""

    __hash__ = cached_hash

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    hbm_gib: float
    hbm_tbps: float
    nvlink_gbps_per_dir: float
    nvlink_gbps_bidir: float
    nvlink_domain: int
    pcie_gen: int
    pcie_gbps_per_dir: float
    ib_gbit_per_gpu: float
    source: str
    power_w: float | None = (
        None  # board power cap where a machine runs below the part's (kernels.yaml power_w)
    )

    @property
    def peak_bf16_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def peak_fp8_flops(self) -> float | None:
        return None if self.fp8_tflops is None else self.fp8_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GiB

    @property
    def nvlink_Bps(self) -> float:
        """NVLink bytes/s per direction: the value the time model uses as NVLink bus bandwidth."""
        return self.nvlink_gbps_per_dir * 1e9

    @property
    def ib_Bps(self) -> float:
        return self.ib_gbit_per_gpu * 1e9 / 8


@lru_cache(maxsize=1)
def _load() -> dict[str, GPUProfile]:
    text = resources.files(__package__).joinpath("hardware.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    profiles = {}
    for name, entry in raw.items():
        missing = [f for f in _FIELDS if f not in entry]
        if missing:
            raise ValueError(f"hardware.yaml: profile {name!r} lacks {', '.join(missing)}")
        profiles[name] = GPUProfile(name=name, **{f: entry[f] for f in _FIELDS})
    return profiles


def load_profiles() -> dict[str, GPUProfile]:
    """All GPU profiles of ``hardware.yaml``, keyed by name (e.g. ``"h100-sxm"``)."""
    return dict(_load())


def get_profile(name: str) -> GPUProfile:
    """The profile called ``name``; ValueError naming the known profiles otherwise."""
    profiles = _load()
    if name not in profiles:
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(profiles))}")
    return profiles[name]


# Exact CUDA device names (torch.cuda.get_device_name, lower case, whole name) -> hardware.yaml
# profile. Whole-name matches on purpose: "H100 NVL" and "H100 PCIe" have lower peaks than the SXM
# part, so a name we do not know is an error, never the nearest guess.
GPU_NAMES = [
    (r"nvidia h100 80gb hbm3|nvidia h100 sxm5? ?(80gb)?", "h100-sxm"),
    (r"nvidia h100 pcie", "h100-pcie"),
    (r"nvidia h100 nvl", "h100-nvl"),
    (r"nvidia h200", "h200"),
    (r"nvidia a100-(sxm4|pcie)-40gb", "a100-40gb"),
    (r"nvidia a100-(sxm4|pcie)-80gb|nvidia a100 80gb pcie", "a100-80gb"),
    (r"nvidia b200", "b200"),
]
# matmul precision -> share of the dense bf16 tensor-core peak. TF32 runs at half the bf16 rate on
# A100, H100 (SXM, PCIe, NVL), H200 and B200 (their datasheets); plain fp32 (CUDA cores, TF32 off)
# has no tensor-core figure here, so fp32 training on a GPU turns TF32 on (enable_tf32).
_SHARE_OF_BF16 = {"bf16": 1.0, "fp16": 1.0, "tf32": 0.5}


def gpu_profile_name(device_name: str) -> str | None:
    """hardware.yaml profile for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm")."""
    name = " ".join(device_name.lower().split())
    for pattern, profile in GPU_NAMES:
        if re.fullmatch(pattern, name):
            return profile
    return None


def datasheet_peak(profile: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a known GPU for bf16 | fp16 | tf32 | fp8 (None: no such tensor
    cores)."""
    p = get_profile(profile)
    if dtype == "fp8":
        return p.peak_fp8_flops
    share = _SHARE_OF_BF16.get(dtype)
    return None if share is None else p.peak_bf16_flops * share


def peak_flops(device, dtype: str = "bf16") -> tuple[float, str]:
    """(peak FLOP/s per device, source) of a torch device. dtype: the matmul precision, bf16 | fp16
    | fp8 | fp32; on a GPU fp32 means TF32 when it is on (enable_tf32) and is refused otherwise.

    An unknown GPU is a UserError naming hardware.yaml rather than an invented peak. Every peak
    carries its source ("datasheet: h100-sxm bf16", "... tf32" or perf.CPU_PROBE_SOURCE)."""
    import torch

    from dtrain.core.errors import UserError
    from dtrain.model import perf

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = gpu_profile_name(name)
        if profile is None:
            raise UserError(
                f"no datasheet peak for GPU {name!r}, so no MFU: add its profile to "
                "dtrain/costmodel/hardware.yaml and its name to dtrain.costmodel.hardware.GPU_NAMES"
            )
        if dtype == "fp32":
            dtype = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        peak = datasheet_peak(profile, dtype)
        if peak is None:
            raise UserError(
                f"{profile} has no {dtype} tensor-core peak in dtrain/costmodel/hardware.yaml "
                "(fp8: Ada/Hopper and newer; fp32: turn TF32 on)"
            )
        return peak, f"datasheet: {profile} {dtype}"
    return perf.cpu_matmul_probe(), perf.CPU_PROBE_SOURCE


@dataclass(frozen=True)
class LinkModel:
    """α–β model of one link class: a message of B bytes costs ``alpha_s + B / beta_Bps`` per hop.

    ``beta_Bps`` is a *bus* bandwidth in the nccl-tests sense (busbw = algbw · 2(n−1)/n for
    all-reduce), so a busbw measured by allreduce-bench can be dropped in unchanged.

    ``collectives``: (name, α per hop, β) of collectives measured apart from all-reduce
    (allreduce-bench fits each one). Their bus bandwidths can differ: gloo on CPU reaches about
    half the all-reduce busbw in all_gather / reduce_scatter, NCCL about the same. ``of(name)``
    is the link a collective of that name runs at; unmeasured ones use ``alpha_s`` / ``beta_Bps``.
    """

    __hash__ = cached_hash

    alpha_s: float
    beta_Bps: float
    name: str = ""
    collectives: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.beta_Bps <= 0:
            raise ValueError(f"LinkModel needs alpha_s >= 0 and beta_Bps > 0, got {self}")
        if any(a < 0 or b <= 0 for _, a, b in self.collectives):
            raise ValueError(
                f"LinkModel collectives need alpha >= 0 and beta > 0, got {self.collectives}"
            )

    def of(self, collective: str) -> "LinkModel":
        for name, alpha, beta in self.collectives:
            if name == collective:
                return LinkModel(alpha, beta, f"{self.name} {collective}".strip())
        return self


# Latency defaults (assumption, order of magnitude of nccl-tests small-message times: ~10-20 µs
# for an 8-GPU NVLink all-reduce = 14 ring hops, a few µs per InfiniBand hop). allreduce-bench
# replaces them with fitted values.
NVLINK_ALPHA_S = 1e-6
IB_ALPHA_S = 5e-6
# Share of the datasheet rate a collective's bus bandwidth reaches (calibrate.default_links applies
# it; a measured allreduce-bench fit replaces it): fitted to dtrain backtest's development set, a
# test pins it.
LINK_EFFICIENCY = 0.7


@dataclass(frozen=True)
class Cluster:
    """The machine: ``gpus`` GPUs of one kind, ``gpus_per_node`` per node.

    ``nvlink`` is the intra-node link (per-GPU, per-direction bus bandwidth) and ``ib`` the
    inter-node link *of one GPU* (its own NIC: 400 Gbit/s = 50 GB/s). Nodes are assumed
    rail-optimised, one NIC per GPU, as in DGX/HGX systems; see ``collectives.group_link``.
    """

    __hash__ = cached_hash

    gpus: int
    gpus_per_node: int
    gpu: GPUProfile
    nvlink: LinkModel
    ib: LinkModel

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"cluster needs gpus >= 1 and gpus_per_node >= 1, got {self.gpus}, "
                f"{self.gpus_per_node}"
            )
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"{self.gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes"
            )

    @property
    def node_size(self) -> int:
        """GPUs that share one node (fewer than gpus_per_node when the job is a partial node)."""
        return min(self.gpus, self.gpus_per_node)

    @classmethod
    def from_profile(
        cls,
        gpu: str | GPUProfile,
        gpus: int,
        gpus_per_node: int = 8,
        ib_gbit_per_gpu: float | None = None,
        nvlink_gbps_per_dir: float | None = None,
        nvlink_alpha_s: float = NVLINK_ALPHA_S,
        ib_alpha_s: float = IB_ALPHA_S,
    ) -> Cluster:
        """A cluster whose links come from the datasheet (overridable).

        When a node holds more GPUs than one NVLink domain (H100 PCIe: bridged pairs), the
        intra-node link is taken to be PCIe, the slowest path between two GPUs of the node.
        """
        prof = get_profile(gpu) if isinstance(gpu, str) else gpu
        if nvlink_gbps_per_dir is not None:
            intra = LinkModel(nvlink_alpha_s, nvlink_gbps_per_dir * 1e9, "NVLink")
        elif min(gpus, gpus_per_node) <= prof.nvlink_domain:
            intra = LinkModel(nvlink_alpha_s, prof.nvlink_Bps, "NVLink")
        else:
            intra = LinkModel(nvlink_alpha_s, prof.pcie_gbps_per_dir * 1e9, "PCIe")
        ib_gbit = prof.ib_gbit_per_gpu if ib_gbit_per_gpu is None else ib_gbit_per_gpu
        return cls(gpus, gpus_per_node, prof, intra, LinkModel(ib_alpha_s, ib_gbit * 1e9 / 8, "IB"))
