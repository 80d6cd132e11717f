"""The node's topology, as facts for summary.json and as TOPOLOGY.md in the run directory.

Run on rank 0's host (other hosts of a job are assumed to be built the same, and the report says
so). Every tool is optional: without nvidia-smi the report says there is no GPU and describes the
host's CPUs and NUMA nodes instead.
"""

from __future__ import annotations

import contextlib

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from allreduce_bench import linkspeed, topology
from dtrain.results.metrics import write_text_atomic

REPORT = "TOPOLOGY.md"

COMMANDS = {
    "topo": ["nvidia-smi", "topo", "-m"],
    "nvlink": ["nvidia-smi", "nvlink", "-s"],
    "pcie": [
        "nvidia-smi",
        "--query-gpu=index,name,pcie.link.gen.max,pcie.link.width.max",
        "--format=csv,noheader",
    ],
    "ibstat": ["ibstat"],
}


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def collect_raw() -> dict[str, str | None]:
    return {name: _run(cmd) for name, cmd in COMMANDS.items()}


def host_description() -> dict:
    """CPU model, logical CPUs, NUMA nodes (with their CPUs) and memory, from /proc and /sys."""
    model = platform.processor() or None
    with contextlib.suppress(OSError):  # /proc and /sys may be absent (containers, macOS)
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), flags=re.M)
        model = m.group(1).strip() if m else model
    numa = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        with contextlib.suppress(OSError):
            numa[node.name] = (node / "cpulist").read_text().strip()
    mem = None
    with contextlib.suppress(OSError):
        m = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), flags=re.M)
        mem = round(int(m.group(1)) / 2**20, 1) if m else None
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "numa_nodes": numa,
        "memory_gib": mem,
    }


def analyse(raw: dict[str, str | None], gpu_name: str | None = None) -> dict:
    """Parsed key facts; JSON-able. `raw` holds the four tools' outputs (None = tool absent)."""
    try:
        matrix = topology.parse_topo_matrix(raw["topo"]) if raw.get("topo") else None
    except ValueError:  # an output we cannot read is reported raw, not fatal
        matrix, raw["topo"] = None, None
    nvlink = topology.parse_nvlink_status(raw["nvlink"]) if raw.get("nvlink") else None
    pcie = topology.parse_pcie_query(raw["pcie"]) if raw.get("pcie") else None
    ibstat = topology.parse_ibstat(raw["ibstat"]) if raw.get("ibstat") else None
    gpu_name = gpu_name or next((p["name"] for p in (pcie or {}).values()), None)
    intra, intra_how = linkspeed.intra_node_GBps(matrix, nvlink, pcie, gpu_name)
    inter, inter_how = linkspeed.inter_node_GBps(matrix, ibstat)
    if matrix is None:
        intra_how = inter_how = "no GPU here: ranks on CPU over gloo have no datasheet link speed"
    rates = linkspeed.nic_rates_Gbps(ibstat)
    nics = []
    for ca in ibstat or []:
        port = ca["ports"][0] if ca["ports"] else {}
        near = [
            g for g in (matrix.gpus if matrix else []) if ca["name"] in matrix.nearest_nics(g)[1]
        ]
        nics.append(
            {
                "name": ca["name"],
                "ca_type": ca["ca_type"],
                "state": port.get("state"),
                "rate_Gbps": rates.get(ca["name"], port.get("rate_Gbps")),
                "link_layer": port.get("link_layer"),
                "nearest_gpus": near,
            }
        )
    return {
        "source": "nvidia-smi" if matrix else "none",
        "gpu_name": gpu_name,
        "gpu_count": len(matrix.gpus) if matrix else 0,
        "gpu_pair_links": matrix.pair_kinds() if matrix else {},
        "nvlinks_per_gpu": {
            str(g): sum(1 for s in links if s) for g, links in (nvlink or {}).items()
        },
        "gpu_affinity": {
            g: {"cpus": a.get("CPU Affinity"), "numa": a.get("NUMA Affinity")}
            for g, a in (matrix.affinity.items() if matrix else [])
            if g.startswith("GPU")
        },
        "gpu_nearest_nic": {
            g: dict(zip(("level", "nics"), matrix.nearest_nics(g))) for g in matrix.gpus
        }
        if matrix
        else {},
        "nics": nics,
        "theoretical_GBps": {"intra_node": intra, "inter_node": inter},
        "theoretical_how": {"intra_node": intra_how, "inter_node": inter_how},
        "host_cpu": host_description(),
    }


def _table(header: list[str], rows: list[list]) -> list[str]:

    def fmt(cells):
        return "| " + " | ".join("" if c is None else str(c) for c in cells) + " |"

    return [fmt(header), "|" + "---|" * len(header)] + [fmt(r) for r in rows]


def render(facts: dict, raw: dict[str, str | None], hosts: list[str]) -> str:
    host = hosts[0] if hosts else "this host"  # rank 0 writes the report
    lines = [f"# Topology of {host}", ""]
    if len(set(hosts)) > 1:
        lines += [
            f"Job hosts: {', '.join(sorted(set(hosts)))}. Shown: {host} (rank 0); the others are "
            "assumed to be built the same.",
            "",
        ]
    cpu = facts["host_cpu"]
    if facts["source"] == "none":
        lines += [
            "No NVIDIA GPU topology here (`nvidia-smi` absent or it failed): the collectives ran "
            "on CPU over gloo (shared memory / loopback TCP on one host), so there is no NVLink, "
            "PCIe peer or NIC path to describe, and no datasheet bandwidth to compare with.",
            "",
        ]
    else:
        lines += [f"{facts['gpu_count']} x {facts['gpu_name']}.", "", "## Links per GPU pair", ""]
        matrix = topology.parse_topo_matrix(raw["topo"])
        lines += _table(
            [""] + matrix.devices,
            [
                [r] + [matrix.link(r, c) if r != c else "X" for c in matrix.devices]
                for r in matrix.devices
            ],
        )
        lines += [
            "",
            "NV# = # bonded NVLinks; PIX = at most one PCIe bridge; PXB = several bridges; PHB = "
            "through a PCIe host bridge (CPU); NODE = between host bridges of one NUMA node; SYS "
            "= across the CPU interconnect (QPI/UPI/xGMI).",
            "",
            "## CPU / NUMA affinity",
            "",
        ]
        lines += _table(
            ["GPU", "CPU affinity", "NUMA node", "nearest NIC(s)"],
            [
                [
                    g,
                    a["cpus"],
                    a["numa"],
                    f"{', '.join(facts['gpu_nearest_nic'][g]['nics'])} "
                    f"({facts['gpu_nearest_nic'][g]['level']})"
                    if facts["gpu_nearest_nic"][g]["nics"]
                    else "-",
                ]
                for g, a in facts["gpu_affinity"].items()
            ],
        )
    if facts["nics"]:
        lines += ["", "## NICs (ibstat)", ""]
        lines += _table(
            ["NIC", "CA type", "state", "rate (Gb/s)", "link layer", "nearest GPUs"],
            [
                [
                    n["name"],
                    n["ca_type"],
                    n["state"],
                    n["rate_Gbps"],
                    n["link_layer"],
                    ", ".join(n["nearest_gpus"]) or "-",
                ]
                for n in facts["nics"]
            ],
        )
    lines += ["", "## Host", ""]
    lines += _table(
        ["CPU", "logical CPUs", "NUMA nodes (CPUs)", "memory (GiB)"],
        [
            [
                cpu["cpu_model"],
                cpu["logical_cpus"],
                "; ".join(f"{k}: {v}" for k, v in cpu["numa_nodes"].items()) or "-",
                cpu["memory_gib"],
            ]
        ],
    )
    lines += ["", "## What each link class should give (per GPU, per direction)", ""]
    lines += _table(
        ["link class", "theoretical GB/s", "from"],
        [
            [k, "unknown" if v is None else f"{v:.1f}", facts["theoretical_how"][k]]
            for k, v in facts["theoretical_GBps"].items()
        ],
    )
    lines += [
        "",
        "The fitted β of each collective (summary.json, fits) is compared with these as "
        "`beta_pct_of_theoretical`.",
        "",
    ]
    present = {k: v for k, v in raw.items() if v}
    if present:
        lines += ["## Raw outputs", ""]
        for name, text in present.items():
            lines += [
                f"`{' '.join(COMMANDS[name])}`",
                "",
                "```text",
                topology.strip_ansi(text).rstrip(),
                "```",
                "",
            ]
    return "\n".join(lines) + "\n"


def write(run_dir: Path, hosts: list[str], gpu_name: str | None) -> dict:
    """TOPOLOGY.md; returns the facts (the rank function hands them to finalize: summary.json
    "topology")."""
    raw = collect_raw()
    facts = analyse(raw, gpu_name)
    write_text_atomic(Path(run_dir) / REPORT, render(facts, raw, hosts))
    return facts
