"""Topology parsers and link-speed expectations on saved outputs of three real box types."""

from pathlib import Path

import pytest

from allreduce_bench import linkspeed, topology, topology_report

FIX = Path(__file__).parent / "fixtures"


def raw(box: str) -> dict:
    read = lambda name: (FIX / name).read_text() if (FIX / name).exists() else None  # noqa: E731
    return {
        "topo": read(f"{box}_topo.txt"),
        "nvlink": read(f"{box}_nvlink.txt"),
        "pcie": read(f"{box}_query.csv"),
        "ibstat": read(f"{box}_ibstat.txt"),
    }


def test_h100_matrix_with_ansi_header_and_nic_legend():
    text = (FIX / "h100_topo.txt").read_text()
    assert "\x1b[4m" in text  # the fixture keeps nvidia-smi's underline escapes
    m = topology.parse_topo_matrix(text)
    assert m.gpus == [f"GPU{i}" for i in range(8)]
    assert m.nics == [f"mlx5_{i}" for i in range(12)]  # NIC0.. renamed through the NIC legend
    assert m.nic_legend["NIC11"] == "mlx5_11"
    assert m.pair_kinds() == {"NV18": 28} and m.nvlinks("GPU0", "GPU7") == 18
    assert m.link("GPU1", "mlx5_3") == "PIX" and m.link("mlx5_3", "GPU1") == "PIX"
    assert m.link("GPU0", "mlx5_6") == "SYS"
    assert m.affinity["GPU0"] == {
        "CPU Affinity": "0-55,112-167",
        "NUMA Affinity": "0",
        "GPU NUMA ID": "N/A",
    }
    assert m.affinity["GPU6"]["NUMA Affinity"] == "1"
    assert "mlx5_0" not in m.affinity  # NIC rows carry no affinity columns
    assert m.nearest_nics("GPU5") == ("PIX", ["mlx5_9"])


def test_a100_matrix_old_driver_names_nics_in_header():
    m = topology.parse_topo_matrix((FIX / "a100_topo.txt").read_text())
    assert len(m.gpus) == 8 and m.nics == [f"mlx5_{i}" for i in range(10)] and m.nic_legend == {}
    assert m.pair_kinds() == {"NV12": 28}
    assert m.affinity["GPU4"] == {"CPU Affinity": "112-127,240-255", "NUMA Affinity": "7"}
    assert m.nearest_nics("GPU0") == ("PXB", ["mlx5_0", "mlx5_1"])
    assert m.nearest_nics("GPU7") == ("PXB", ["mlx5_8", "mlx5_9"])


def test_pcie_only_matrix():
    m = topology.parse_topo_matrix((FIX / "pcie_topo.txt").read_text())
    assert m.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"] and m.nics == ["mlx5_0"]
    assert m.pair_kinds() == {"PXB": 2, "SYS": 4} and m.nvlinks("GPU0", "GPU1") == 0
    assert m.nearest_nics("GPU3") == ("SYS", ["mlx5_0"])


def test_nvlink_status_and_ibstat():
    nv = topology.parse_nvlink_status((FIX / "h100_nvlink.txt").read_text())
    assert sorted(nv) == list(range(8)) and nv[3] == [26.562] * 18
    assert topology.parse_nvlink_status((FIX / "pcie_nvlink.txt").read_text()) == {
        0: [],
        1: [],
        2: [],
        3: [],
    }
    assert topology.parse_nvlink_status(
        "GPU 0: X (UUID: GPU-1)\n\t Link 0: 25 GB/s\n\t Link 1: <inactive>\n"
    ) == {0: [25.0, None]}
    ib = topology.parse_ibstat((FIX / "h100_ibstat.txt").read_text())
    assert [ca["name"] for ca in ib] == [f"mlx5_{i}" for i in range(12)]
    assert ib[0]["ca_type"] == "MT4129"
    assert ib[0]["ports"] == [
        {
            "port": 1,
            "state": "Active",
            "physical_state": "LinkUp",
            "rate_Gbps": 400.0,
            "link_layer": "InfiniBand",
        }
    ]
    assert ib[8]["ports"][0]["state"] == "Down"
    assert linkspeed.nic_rates_Gbps(ib)[
        "mlx5_1"
    ] == 200.0 and "mlx5_8" not in linkspeed.nic_rates_Gbps(ib)


@pytest.mark.parametrize(
    "box, gpu, intra, inter",
    [
        (
            "h100",
            "NVIDIA H100 80GB HBM3",
            450.0,
            50.0,
        ),  # 18 x 25 GB/s NVLink4; one 400G NIC per GPU
        ("a100", "A100-SXM4-40GB", 300.0, 25.0),  # 12 x 25 GB/s NVLink3; two 200G NICs per GPU pair
        (
            "pcie",
            "NVIDIA L40S",
            16 * 1.969,
            100 / 4 / 8,
        ),  # PCIe Gen4 x16; one 100G NIC for four GPUs
    ],
)
def test_theoretical_bandwidth_per_link_class(box, gpu, intra, inter):
    facts = topology_report.analyse(raw(box), gpu)
    assert facts["source"] == "nvidia-smi" and facts["gpu_count"] in (4, 8)
    assert facts["theoretical_GBps"]["intra_node"] == pytest.approx(intra)
    assert facts["theoretical_GBps"]["inter_node"] == pytest.approx(inter)


def test_nvlink_speed_without_nvlink_status_uses_the_pair_count():
    m = topology.parse_topo_matrix((FIX / "a100_topo.txt").read_text())
    value, how = linkspeed.intra_node_GBps(m, None, None, "NVIDIA A100-SXM4-80GB")
    assert value == 300.0 and "same NV#" in how


def test_report_markdown_for_h100():
    r = raw("h100")
    facts = topology_report.analyse(r, "NVIDIA H100 80GB HBM3")
    md = topology_report.render(facts, r, ["node-a", "node-b"])
    assert "8 x NVIDIA H100 80GB HBM3." in md
    assert "| GPU0 | 0-55,112-167 | 0 | mlx5_0 (PIX) |" in md
    assert "| mlx5_0 | MT4129 | Active | 400.0 | InfiniBand | GPU0 |" in md
    assert "| intra_node | 450.0 |" in md and "| inter_node | 50.0 |" in md
    assert "Job hosts: node-a, node-b" in md
    assert "\x1b" not in md


def test_report_without_gpu_describes_the_host():
    facts = topology_report.analyse({"topo": None, "nvlink": None, "pcie": None, "ibstat": None})
    assert facts["source"] == "none" and facts["theoretical_GBps"] == {
        "intra_node": None,
        "inter_node": None,
    }
    md = topology_report.render(facts, {"topo": None}, ["h"])
    assert "No NVIDIA GPU" in md and "## Host" in md and "logical CPUs" in md
    assert facts["host_cpu"]["logical_cpus"] >= 1


def test_unreadable_topo_output_is_not_fatal():
    facts = topology_report.analyse(
        {
            "topo": "NVML: Driver/library version mismatch",
            "nvlink": None,
            "pcie": None,
            "ibstat": None,
        }
    )
    assert facts["source"] == "none"
