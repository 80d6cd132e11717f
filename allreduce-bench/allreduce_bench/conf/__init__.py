"""allreduce-bench's typed config: every default of `python -m allreduce_bench` (conf/config.yaml
only names it). nccl-tests-style collective benchmark + α–β fit + topology report.

`dtypes` stays its own key (not `precision`): it is a measured dimension, the element types of the
messages swept (ints and float8 included), not the precision a model computes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dtrain.core.nodes import BaseConfig, register


@dataclass
class AllreduceDebugConfig:
    """Test aids that fake a condition, to see the benchmark's handling of it."""

    simulate_nodes: Optional[int] = (
        None  # split this host's ranks into K pretend hosts (the inter-node path)
    )
    inject_wrong: Optional[str] = (
        None  # corrupt one result element of this collective (or 'all'): the check fails
    )


@dataclass
class AlltoallvConfig:
    """all_to_all_v's routing (allreduce_bench.alltoallv): expert parallelism's dispatch."""

    skew: str = "uniform"  # uniform | zipf | hot (one hot expert)
    top_k: int = 2  # experts per token: each token is sent top_k times
    experts_per_rank: int = 4
    tokens: int = 256  # per rank; a row is S / (tokens x top_k) bytes
    zipf_s: float = 1.2  # zipf: p_e ~ 1 / (e + 1)^zipf_s
    hot_share: float = 0.5  # hot: expert 0's probability
    seed: int = 0


@dataclass
class AllreduceBenchConfig(BaseConfig):
    subproject: str = "allreduce-bench"
    collectives: Any = field(
        default_factory=lambda: [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "reduce",
            "all_to_all",
            "all_to_all_v",
            "sendrecv",
        ]
    )  # one name or a list
    min_bytes: Any = "1K"  # nccl-tests -b (an integer, or suffixes K, M, G = powers of 1024)
    max_bytes: Any = "4M"  # nccl-tests -e
    step_factor: float = 4  # nccl-tests -f: next size = size x factor
    dtypes: Any = field(
        default_factory=lambda: ["float32"]
        # float32 | bfloat16 | float16 | float64 | int32 | int64 | int8 | uint8 | float8_e4m3fn |
        # float8_e5m2
    )
    redop: str = "sum"  # sum | prod | max | min | avg   (nccl-tests -o)
    modes: Any = field(
        default_factory=lambda: ["out_of_place", "in_place"]
    )  # torch lacks one of them for some collectives: N/A
    root: int = 0  # root rank of broadcast / reduce (nccl-tests -r), a rank of each measured group
    timing_warmup: int = 2  # nccl-tests -w: untimed ops per size
    iters: int = 10  # nccl-tests -n: timed ops per size, back to back; time = total / iters
    check: bool = True  # nccl-tests -c: one checked run per case; any wrong element fails the run
    alltoallv: AlltoallvConfig = field(default_factory=AlltoallvConfig)
    debug: AllreduceDebugConfig = field(default_factory=AllreduceDebugConfig)


RENAMED = {"warmup_iters": "timing_warmup"}
register("allreduce_bench_schema", AllreduceBenchConfig)
