"""Which ranks measure which link class, as process sub-groups.

    one host      intra_node = the whole world
    several hosts intra_node = one group per host (all hosts at once: each GPU's NVLink, like a
                  TP group); inter_node = one group per local rank index, pairing ranks on
                  different hosts (all rails at once: each GPU's own NIC, like an HSDP replica
                  group); world = every rank (what nccl-tests would show for the job)

Groups of one class run concurrently, and the timing barrier spans the world, so a class is
measured under the load it sees in training. A rank outside every group of a class idles at the
barriers. `debug.simulate_nodes=K` splits one host's ranks into K pretend hosts, to test the
multi-host path on a laptop (the numbers then say nothing about real links).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

LINK_CLASSES = ("intra_node", "inter_node", "world")


def simulated_hosts(world: int, nodes: int) -> list[str]:
    per = world // nodes
    return [f"simulated-node{r // per}" for r in range(world)]


def plan(hosts: list[str]) -> tuple[list[tuple[str, list[list[int]]]], dict[str, str]]:
    """[(link_class, groups of global ranks)] and {link_class: why it was not measured}."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    everyone = list(range(len(hosts)))
    if len(by_host) == 1:
        return [("intra_node", [everyone])], {
            "inter_node": "all ranks ran on one host",
            "world": "same ranks as intra_node (one host)",
        }
    classes, missing = [], {}
    intra = [ranks for ranks in by_host.values() if len(ranks) > 1]
    if intra:
        classes.append(("intra_node", intra))
    else:
        missing["intra_node"] = "one rank per host"
    rails = min(len(ranks) for ranks in by_host.values())
    classes.append(("inter_node", [[ranks[k] for ranks in by_host.values()] for k in range(rails)]))
    classes.append(("world", [everyone]))
    return classes, missing


@dataclass
class LinkGroup:
    link_class: str
    group: object | None  # this rank's process group for the class; None = idle
    size: int  # ranks per group
    count: int  # groups measured concurrently


def build(classes: list[tuple[str, list[list[int]]]]) -> list[LinkGroup]:
    """Create the process groups (every rank creates every group, in the same order)."""
    out, rank, world = [], dist.get_rank(), dist.get_world_size()
    for link_class, groups in classes:
        if len(groups) == 1 and len(groups[0]) == world:
            mine = dist.group.WORLD
        else:
            mine = None
            for ranks in groups:
                g = dist.new_group(ranks)
                if rank in ranks:
                    mine = g
        out.append(LinkGroup(link_class, mine, len(groups[0]), len(groups)))
    return out
