"""Config parsing, link-class groups and the correctness check, without processes."""

import pytest
import torch
from omegaconf import OmegaConf

from allreduce_bench import collectives, groups, spec, sweep
from allreduce_bench import busbw
from allreduce_bench.busbw import layout
from allreduce_bench.conf import AllreduceBenchConfig
from dtrain.core.errors import UserError


def cfg(**over):
    base = OmegaConf.structured(AllreduceBenchConfig)
    base.world_size = 2
    for k, v in over.items():
        OmegaConf.update(base, k, v)
    return base


def test_sizes_and_aliases():
    assert spec.parse_bytes("1K", "x") == 1024 and spec.parse_bytes("4MiB", "x") == 4 * 2**20
    assert spec.parse_bytes(512, "x") == 512 and spec.parse_bytes("1G", "x") == 2**30
    s = spec.parse(cfg(dtypes=["bf16", "fp32"]))
    assert s.sizes == (1024, 4096, 16384, 65536, 262144, 2**20, 4 * 2**20)
    assert s.dtypes == ("bfloat16", "float32")


@pytest.mark.parametrize(
    "over, message",
    [
        ({"collectives": ["allreduce"]}, "collectives='allreduce' must be one of all_reduce, "),
        ({"min_bytes": "4M", "max_bytes": "1K"}, "min_bytes=4M is larger than max_bytes=1K"),
        ({"min_bytes": "1X"}, "is not a size"),
        ({"dtypes": ["fp4"]}, "dtypes='fp4' must be one of float32, float16, "),
        ({"redop": "mean"}, "redop='mean' must be one of sum, "),
        ({"step_factor": 1}, "step_factor=1.0 must be a number > 1"),
        ({"root": 2}, "root=2 is not a rank of world_size=2"),
        (
            {"debug.simulate_nodes": 3},
            "simulate_nodes=3 must be an integer >= 2 dividing world_size=2",
        ),
        (
            {"modes": ["out_of_place"], "collectives": ["all_reduce"]},
            "collective all_reduce has no out_of_place form in torch.distributed: add in_place to "
            "modes",
        ),
        (
            {"modes": ["in_place"], "collectives": ["all_gather", "all_to_all"]},
            "collective all_to_all has no in_place form in torch.distributed: add out_of_place to "
            "modes",
        ),
        ({"modes": []}, "modes=\\[\\] is empty"),
    ],
)
def test_bad_config_is_one_user_error(over, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        spec.parse(cfg(**over))


def test_known_unsupported_combinations():
    assert "cannot move float8_e4m3fn" in spec.known_unsupported(
        "gloo", "float8_e4m3fn", "sum", ["all_gather"]
    )
    assert "redop=avg" in spec.known_unsupported("gloo", "int32", "avg", ["all_reduce"])
    assert (
        spec.known_unsupported("gloo", "bfloat16", "sum", ["all_reduce"]) is None
    )  # gloo reduces bf16 in torch 2.13
    assert spec.known_unsupported("nccl", "float8_e4m3fn", "sum", ["all_gather"]) is None


def test_backend_refusal_becomes_user_error_but_other_failures_do_not():
    with pytest.raises(UserError, match="backend=gloo cannot run all_reduce on dtype=float8_e5m2"):
        with sweep.unsupported_as_user_error("all_reduce", "float8_e5m2", "sum", "gloo"):
            raise RuntimeError("Invalid scalar type")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        with sweep.unsupported_as_user_error("all_reduce", "float32", "sum", "gloo"):
            raise RuntimeError("Connection closed by peer")


def test_link_class_plan():
    classes, missing = groups.plan(["a"] * 4)
    assert classes == [("intra_node", [[0, 1, 2, 3]])] and "inter_node" in missing
    classes, missing = groups.plan(["a"] * 4 + ["b"] * 4)
    assert classes == [
        ("intra_node", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("inter_node", [[0, 4], [1, 5], [2, 6], [3, 7]]),  # rank k pairs with its rail peer
        ("world", [list(range(8))]),
    ]
    classes, missing = groups.plan(["a", "b", "c"])
    assert [c for c, _ in classes] == ["inter_node", "world"] and missing == {
        "intra_node": "one rank per host"
    }
    assert groups.simulated_hosts(4, 2) == ["simulated-node0"] * 2 + ["simulated-node1"] * 2


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
)
def test_expected_results_by_hand(dtype):
    n = 2

    def vals(j, redop):
        return collectives.input_values(j, 8, 2, redop, dtype, "cpu")

    # sum inputs are (pos + 3 rank) % 4: rank 0 = 0,1,2,3,0,..; rank 1 = 3,0,1,2,3,..
    want = torch.tensor([3, 1, 3, 5, 3, 1, 3, 5], dtype=torch.float32)
    got = collectives.reduce_expected(lambda j: vals(j, "sum"), n, "sum", dtype)
    assert torch.equal(got.to(torch.float32), want)
    assert torch.equal(
        collectives.reduce_expected(lambda j: vals(j, "prod"), n, "prod", dtype).to(torch.float32),
        torch.full((8,), 2.0),
    )  # exactly one rank holds a 2 at every position
    mx = collectives.reduce_expected(lambda j: vals(j, "max"), n, "max", dtype)
    assert torch.equal(mx, torch.maximum(vals(0, "max"), vals(1, "max")).to(dtype))


def test_count_wrong_catches_one_corrupted_element():
    expected = collectives.reduce_expected(
        lambda j: collectives.input_values(j, 1000, 4, "sum", torch.bfloat16, "cpu"),
        4,
        "sum",
        torch.bfloat16,
    )
    result = expected.clone()
    assert collectives.count_wrong(result, expected, 4, "sum") == 0
    result[123] += 1
    assert collectives.count_wrong(result, expected, 4, "sum") == 1
    result[7] = float("nan")
    assert collectives.count_wrong(result, expected, 4, "sum") == 2


def test_in_place_and_out_of_place_support_follows_torch_api():
    assert not busbw.supports("all_reduce", in_place=False) and busbw.supports("all_reduce", True)
    assert busbw.supports("all_gather", True) and busbw.supports("all_gather", False)
    assert not busbw.supports("sendrecv", in_place=True)
    assert (
        collectives.build(
            "all_to_all",
            layout("all_to_all", 64, 4, 2),
            torch.float32,
            "cpu",
            None,
            "sum",
            0,
            in_place=True,
        )
        is None
    )
