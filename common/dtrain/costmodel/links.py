"""The links of a cluster as the cost model uses them: α per link class and the share of the
datasheet rate collectives reach, published defaults until allreduce-bench measures them
(``calibrate`` replaces them). Kept apart from ``calibrate`` so ``dtrain plan`` needs neither
pandas nor torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import IB_ALPHA_S, LINK_EFFICIENCY, NVLINK_ALPHA_S, Cluster, LinkModel
from .calibration import Param

LINK_EFFICIENCY_SOURCE = (
    "share of the datasheet link rate (NVLink per direction, NIC line rate) that collectives' "
    "bus bandwidth reaches: fitted to the development set of dtrain backtest (leave-one-source-"
    "out there), until allreduce-bench measures it on the cluster"
)


@dataclass(frozen=True)
class LinkCalibration:
    """α per link class and the achieved share of the nominal rate (β measured / β datasheet)."""

    intra_alpha_s: Param
    intra_efficiency: Param
    inter_alpha_s: Param
    inter_efficiency: Param

    def apply(self, cluster: Cluster) -> Cluster:
        intra = LinkModel(
            self.intra_alpha_s.value,
            cluster.nvlink.beta_Bps * self.intra_efficiency.value,
            cluster.nvlink.name,
        )
        inter = LinkModel(
            self.inter_alpha_s.value,
            cluster.ib.beta_Bps * self.inter_efficiency.value,
            cluster.ib.name,
        )
        return replace(cluster, nvlink=intra, ib=inter)


def default_links() -> LinkCalibration:
    pub = "datasheet/published: "
    return LinkCalibration(
        Param(
            NVLINK_ALPHA_S,
            pub + "assumption, order of magnitude of nccl-tests small-message latency "
            "on an NVSwitch node (dtrain.costmodel.hardware.NVLINK_ALPHA_S)",
        ),
        Param(LINK_EFFICIENCY, pub + LINK_EFFICIENCY_SOURCE),
        Param(
            IB_ALPHA_S,
            pub + "assumption, a few µs per InfiniBand hop (dtrain.costmodel.hardware.IB_ALPHA_S)",
        ),
        Param(LINK_EFFICIENCY, pub + LINK_EFFICIENCY_SOURCE),
    )
