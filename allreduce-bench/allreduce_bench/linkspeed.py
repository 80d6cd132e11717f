"""What bandwidth each link class should give, per GPU and per direction (datasheet values).

These are the β a perfect collective would reach (nccl-tests' busbw is per direction too), so
`beta_pct_of_theoretical` = fitted β / this. Sources: NVLink 2/3/4 move 25 GB/s per link per
direction (V100 6 links = 150, A100 12 = 300, H100 18 = 450 GB/s), NVLink 5 50 GB/s (B200 18 =
900); PCIe per lane per direction after line encoding: Gen3 0.985, Gen4 1.969, Gen5 3.938 GB/s;
an InfiniBand/RoCE port's `Rate` (Gb/s) / 8. `nvidia-smi nvlink -s` prints the raw signalling rate
(26.562 GB/s on H100), above what data can use, so it counts links, not speed, unless the GPU is
unknown here.
"""

from __future__ import annotations

from allreduce_bench.topology import TopoMatrix

NVLINK_GBPS_PER_LINK = (
    ("GB200", 50.0),
    ("B200", 50.0),
    ("B100", 50.0),
    ("GH200", 25.0),
    ("H200", 25.0),
    ("H100", 25.0),
    ("H800", 25.0),
    ("H20", 25.0),
    ("A100", 25.0),
    ("A800", 25.0),
    ("V100", 25.0),
    ("P100", 20.0),
)
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def nvlink_per_link_GBps(gpu_name: str | None, nvlink: dict[int, list] | None) -> float | None:
    for key, speed in NVLINK_GBPS_PER_LINK:
        if gpu_name and key in gpu_name.upper():
            return speed
    raw = [s for links in (nvlink or {}).values() for s in links if s]
    return min(raw) if raw else None


def _active_links(nvlink: dict[int, list] | None) -> int | None:
    counts = [sum(1 for s in links if s) for links in (nvlink or {}).values()]
    return min(counts) if counts and min(counts) > 0 else None


def pcie_GBps(pcie: dict[int, dict] | None) -> tuple[float | None, str]:
    rates = [
        (PCIE_GBPS_PER_LANE.get(p["gen"], 0) * (p["width"] or 0), p)
        for p in (pcie or {}).values()
        if p.get("gen") and p.get("width")
    ]
    if not rates:
        return None, "PCIe generation/width unknown"
    rate, p = min(rates, key=lambda t: t[0])
    return rate, f"PCIe Gen{p['gen']} x{p['width']} per GPU"


def intra_node_GBps(
    matrix: TopoMatrix | None, nvlink: dict | None, pcie: dict | None, gpu_name: str | None
) -> tuple[float | None, str]:
    """Per-GPU bus bandwidth between GPUs of one node, and how it was derived."""
    if matrix is None or len(matrix.gpus) < 2:
        return None, "fewer than two GPUs on the node"
    pairs = matrix.gpu_pairs()
    nv = [matrix.nvlinks(a, b) for a, b in pairs]
    if all(nv):
        per_link = nvlink_per_link_GBps(gpu_name, nvlink)
        links = _active_links(nvlink)
        how = "active links in nvidia-smi nvlink -s"
        if links is None and len(set(nv)) == 1:
            links, how = nv[0], "every GPU pair has the same NV# (NVSwitch, or two GPUs)"
        elif links is None:  # direct mesh: a GPU's links are split between its peers
            links = min(
                sum(matrix.nvlinks(g, p) for p in matrix.gpus if p != g) for g in matrix.gpus
            )
            how = "sum of NV# over a GPU's peers (direct NVLink mesh)"
        if per_link is None:
            return None, f"{links} NVLinks per GPU, speed unknown for {gpu_name!r}"
        return links * per_link, f"NVLink: {links} links x {per_link:g} GB/s per direction ({how})"
    rate, how = pcie_GBps(pcie)
    mixed = (
        "some GPU pairs have no NVLink, so a ring over all GPUs is bound by PCIe; "
        if any(nv)
        else ""
    )
    return rate, mixed + how


def nic_rates_Gbps(ibstat: list[dict] | None) -> dict[str, float]:
    """Active ports' rate per HCA (an HCA's best port; topo -m lists one device per port)."""
    out = {}
    for ca in ibstat or []:
        rates = [
            p["rate_Gbps"] for p in ca["ports"] if p.get("state") == "Active" and p.get("rate_Gbps")
        ]
        if rates:
            out[ca["name"]] = max(rates)
    return out


def inter_node_GBps(
    matrix: TopoMatrix | None, ibstat: list[dict] | None
) -> tuple[float | None, str]:
    """Per-GPU network bandwidth: each GPU uses its nearest NIC(s); a NIC nearest to k GPUs gives
    each 1/k of its rate. The slowest GPU bounds a collective over all of them."""
    rates = nic_rates_Gbps(ibstat)
    if matrix is None or not matrix.gpus:
        return None, "no GPU topology"
    if not rates:
        return None, "no active InfiniBand/RoCE port (ibstat absent or all ports down)"
    nearest = {g: matrix.nearest_nics(g) for g in matrix.gpus}
    users: dict[str, int] = {}
    for _, nics in nearest.values():
        for nic in nics:
            users[nic] = users.get(nic, 0) + 1
    per_gpu = {
        g: sum(rates.get(nic, 0.0) / users[nic] for nic in nics) / 8
        for g, (_, nics) in nearest.items()
    }
    worst = min(per_gpu, key=per_gpu.get)
    if per_gpu[worst] <= 0:
        return None, f"{worst} has no active NIC near it"
    level, nics = nearest[worst]
    shared = max(users[n] for n in nics)
    return per_gpu[worst], (
        f"nearest NIC(s) of {worst} via {level}: {', '.join(nics)} at "
        f"{', '.join(f'{rates.get(n, 0):g}' for n in nics)} Gb/s, shared by {shared} GPU(s)"
    )
