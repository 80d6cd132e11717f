"""GPU profiles (from ``hardware.yaml``), link models and the cluster a plan runs on.

Every number in ``hardware.yaml`` is a datasheet figure with its ``source``; units are documented
at the top of that file. The cost model uses *dense* tensor-core peaks (no 2:4 sparsity) and the
NVLink bandwidth *per direction* (H100: 450 GB/s of the datasheet's 900 GB/s total), because that
is the figure nccl-tests' bus bandwidth is comparable with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml
from .hashing import cached_hash

GiB = 1024**3
_FIELDS = (
    "bf16_tflops", "fp8_tflops", "hbm_gib", "hbm_tbps", "nvlink_gbps_per_dir", "nvlink_gbps_bidir",
    "nvlink_domain", "pcie_gen", "pcie_gbps_per_dir", "ib_gbit_per_gpu", "source",
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
    power_w: float | None = None    # board power cap where a machine runs below the part's (kernels.yaml power_w)

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
            raise ValueError(f"LinkModel collectives need alpha >= 0 and beta > 0, got {self.collectives}")

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
# Share of the datasheet rate a collective's bus bandwidth reaches (calibrate.default_links applies it; a
# measured allreduce-bench fit replaces it): fitted to dtrain backtest's development set, a test pins it.
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Cluster:
    """The machine: ``gpus`` GPUs of one kind, ``gpus_per_node`` per node.

    ``nvlink`` is the intra-node link (per-GPU, per-direction bus bandwidth) and ``ib`` the
    inter-node link *of one GPU* (its own NIC: 400 Gbit/s = 50 GB/s). Nodes are assumed
    rail-optimised, one NIC per GPU, as in DGX/HGX systems; see ``timemodel.group_link``.
    """

    __hash__ = cached_hash

    gpus: int
    gpus_per_node: int
    gpu: GPUProfile
    nvlink: LinkModel
    ib: LinkModel

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster needs gpus >= 1 and gpus_per_node >= 1, got {self.gpus}, "
                             f"{self.gpus_per_node}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes")

    @property
    def node_size(self) -> int:
        """GPUs that share one node (fewer than gpus_per_node when the job is a partial node)."""
        return min(self.gpus, self.gpus_per_node)

    @classmethod
    def from_profile(cls, gpu: str | GPUProfile, gpus: int, gpus_per_node: int = 8,
                     ib_gbit_per_gpu: float | None = None, nvlink_gbps_per_dir: float | None = None,
                     nvlink_alpha_s: float = NVLINK_ALPHA_S, ib_alpha_s: float = IB_ALPHA_S) -> Cluster:
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
