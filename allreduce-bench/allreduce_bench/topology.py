"""Parsers for what NVIDIA and Mellanox tools print about a node's links.

    nvidia-smi topo -m     GPU/NIC matrix (NV#, PIX, PXB, PHB, NODE, SYS), CPU/NUMA affinity
                           columns, the NIC legend (newer drivers name NICs NIC0.. and list the
                           device below; older ones put mlx5_0.. in the header), ANSI underline
                           escapes in the header line
    nvidia-smi nvlink -s   per-GPU link speeds (GB/s per direction; <inactive> links)
    ibstat                 HCAs, ports, state, rate (Gb/s), link layer
    nvidia-smi --query-gpu=index,name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader

Pure functions on text: the tests run them on saved outputs of real boxes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# closeness of a PCIe path, best first ("SOC" is the old name of SYS)
PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_DEVICE = re.compile(r"^\S+$")  # device labels have no spaces; "CPU Affinity" & co. do


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


@dataclass
class TopoMatrix:
    devices: list[str]  # column labels in order, NICs already renamed
    links: dict[tuple[str, str], str]  # (row, column) -> X | NV18 | PIX | ... | SYS
    affinity: dict[str, dict[str, str]] = field(
        default_factory=dict
    )  # device -> {"CPU Affinity": ..}
    nic_legend: dict[str, str] = field(default_factory=dict)  # NIC0 -> mlx5_0

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if re.fullmatch(r"GPU\d+", d)]

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if not re.fullmatch(r"GPU\d+", d)]

    def link(self, a: str, b: str) -> str:
        return self.links.get((a, b)) or self.links.get((b, a), "?")

    def nvlinks(self, a: str, b: str) -> int:
        m = re.fullmatch(r"NV(\d+)", self.link(a, b))
        return int(m.group(1)) if m else 0

    def gpu_pairs(self) -> list[tuple[str, str]]:
        g = self.gpus
        return [(a, b) for i, a in enumerate(g) for b in g[i + 1 :]]

    def pair_kinds(self) -> dict[str, int]:
        """How many GPU pairs have each link kind, e.g. {'NV18': 28}."""
        out: dict[str, int] = {}
        for a, b in self.gpu_pairs():
            out[self.link(a, b)] = out.get(self.link(a, b), 0) + 1
        return out

    def nearest_nics(self, gpu: str) -> tuple[str | None, list[str]]:
        """(PCIe level, NICs at that level): the NICs this GPU should use for inter-node traffic."""
        by_level: dict[str, list[str]] = {}
        for nic in self.nics:
            level = self.link(gpu, nic)
            if level in PCIE_LEVELS:
                by_level.setdefault(level, []).append(nic)
        for level in PCIE_LEVELS:
            if level in by_level:
                return level, by_level[level]
        return None, []


def parse_topo_matrix(text: str) -> TopoMatrix:
    lines = [strip_ansi(line).rstrip() for line in text.splitlines()]
    try:
        h = next(
            i
            for i, line in enumerate(lines)
            if re.search(r"\bGPU0\b", line) and not line.lstrip().startswith("GPU0 ")
        )
    except StopIteration:
        raise ValueError(
            "no GPU matrix header (a line naming GPU0) in nvidia-smi topo -m output"
        ) from None
    columns = [c.strip() for c in lines[h].split("\t") if c.strip()]
    if len(columns) == 1:  # header without tabs: fall back to runs of 2+ spaces
        columns = [c for c in re.split(r"\s{2,}|\t", lines[h].strip()) if c]
    n_dev = next((i for i, c in enumerate(columns) if not _DEVICE.match(c)), len(columns))
    devices, extra = columns[:n_dev], columns[n_dev:]
    links: dict[tuple[str, str], str] = {}
    affinity: dict[str, dict[str, str]] = {}
    for line in lines[h + 1 :]:
        tokens = line.split()
        if not tokens or tokens[0] not in devices:
            if tokens and tokens[0].startswith("Legend"):
                break
            continue
        row, cells = tokens[0], tokens[1:]
        for col, cell in zip(devices, cells[:n_dev]):
            links[(row, col)] = "SYS" if cell == "SOC" else cell
        values = cells[n_dev:]
        if values:
            affinity[row] = dict(zip(extra, values))
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", "\n".join(lines), flags=re.M))
    rename = lambda d: legend.get(d, d)  # noqa: E731
    return TopoMatrix(
        devices=[rename(d) for d in devices],
        links={(rename(a), rename(b)): v for (a, b), v in links.items()},
        affinity={rename(d): v for d, v in affinity.items()},
        nic_legend=legend,
    )


def parse_nvlink_status(text: str) -> dict[int, list[float | None]]:
    """GPU index -> per-link speed in GB/s (None for an inactive link)."""
    out: dict[int, list[float | None]] = {}
    gpu = None
    for line in strip_ansi(text).splitlines():
        m = re.match(r"^GPU (\d+):", line.strip())
        if m:
            gpu = int(m.group(1))
            out[gpu] = []
            continue
        m = re.match(r"^\s*Link (\d+):\s*(.+?)\s*$", line)
        if m and gpu is not None:
            speed = re.match(r"([\d.]+)\s*GB/s", m.group(2))
            out[gpu].append(float(speed.group(1)) if speed else None)
    return out


def parse_ibstat(text: str) -> list[dict]:
    """[{name, ca_type, ports: [{port, state, physical_state, rate_Gbps, link_layer}]}]."""
    cas: list[dict] = []
    port = None
    for line in strip_ansi(text).splitlines():
        s = line.strip()
        m = re.match(r"^CA '([^']+)'", s)
        if m:
            cas.append({"name": m.group(1), "ca_type": None, "ports": []})
            port = None
            continue
        if not cas:
            continue
        m = re.match(r"^Port (\d+):$", s)
        if m:
            port = {
                "port": int(m.group(1)),
                "state": None,
                "physical_state": None,
                "rate_Gbps": None,
                "link_layer": None,
            }
            cas[-1]["ports"].append(port)
            continue
        key, _, value = s.partition(":")
        value = value.strip()
        if key == "CA type":
            cas[-1]["ca_type"] = value
        elif port is not None and key in ("State", "Physical state", "Rate", "Link layer"):
            name = {
                "State": "state",
                "Physical state": "physical_state",
                "Rate": "rate_Gbps",
                "Link layer": "link_layer",
            }[key]
            port[name] = float(value) if key == "Rate" else value
    return cas


def parse_pcie_query(text: str) -> dict[int, dict]:
    """`index, name, pcie.link.gen.max, pcie.link.width.max` CSV rows -> {index: {name, gen,
    width}}."""
    out = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            gen = int(parts[2]) if parts[2].isdigit() else None
            width = int(parts[3]) if parts[3].isdigit() else None
            out[int(parts[0])] = {"name": parts[1], "gen": gen, "width": width}
    return out
