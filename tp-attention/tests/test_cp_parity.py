"""Context-parallel attention (ring and all-to-all) == one device, on gloo ranks: output, input
gradient and every weight gradient within 1e-5 relative (fp32) for random MHA / GQA layers (k/v
heads below cp included), counted bytes = the analytic formula; and the check FAILS when the ring
merges its partial results without the log-sum-exp rescaling (a planted bug), so it can catch one.

Seeds are drawn per run and printed (reproduce with CP_PARITY_SEED=<seed>)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from omegaconf import OmegaConf

from conftest import local_cpu_run
from dtrain.parallel.cp.trainer_cp import ContextParallelCore
from dtrain.run.launch import launch
from tp_attention.cp.parity import check_case, draw_case, failures

RTOL = 1e-5


def add_without_rescaling(out, lse, block_out, block_lse):
    """The planted bug: partial outputs summed as if their softmax denominators were the same."""
    return out + block_out, torch.logaddexp(lse, block_lse)


def parity_cases(ctx) -> list[dict]:
    """Every case in ctx.cfg.cases on this rank (the whole world is one cp group); the planted
    bug's cases use the wrong merge."""
    import torch.distributed as dist

    out = []
    for spec in OmegaConf.to_container(ctx.cfg.cases):
        case, seed = spec["case"], spec["seed"]
        core = (
            ContextParallelCore("ring", dist.group.WORLD, merge=add_without_rescaling)
            if spec["planted"]
            else None
        )
        errs, volume = check_case(case, dist.group.WORLD, seed, ctx.device, core=core)
        out.append(
            {"case": case, "seed": seed, "planted": spec["planted"], "errs": errs, "volume": volume}
        )
    return out


def run_cases(tmp_path, cp: int, n_random: int) -> list[dict]:
    seed = int(os.environ.get("CP_PARITY_SEED", random.randrange(1 << 30)))
    print(f"cp parity seed={seed} (rerun: CP_PARITY_SEED={seed} pytest ...)")
    rng = random.Random(seed)
    cases = []
    for impl in ("ring", "ulysses"):
        for _ in range(n_random):
            cases.append(
                {"case": draw_case(rng, cp, impl), "seed": rng.randrange(1 << 30), "planted": False}
            )
    gqa = {
        "impl": "ring",
        "cp": cp,
        "n_head": 4,
        "n_kv_head": 1,
        "head_dim": 8,
        "batch": 2,
        "seq": 4 * cp,
        "bias": True,
    }
    cases.append({"case": gqa, "seed": rng.randrange(1 << 30), "planted": False})
    cases.append({"case": gqa, "seed": rng.randrange(1 << 30), "planted": True})
    cfg = local_cpu_run(cp, seed=seed, cases=cases)
    run_dir = tmp_path / f"cp{cp}"
    run_dir.mkdir()
    got = launch(parity_cases, cfg, run_dir)[0]
    for r in got:
        print(
            r["case"],
            "seed",
            r["seed"],
            "planted" if r["planted"] else "",
            f"worst {max(r['errs'].values()):.1e}",
        )
    return got


def assert_parity(results: list[dict]) -> None:
    for r in results:
        bad = failures(r["errs"], r["volume"], RTOL)
        if r["planted"]:  # the check must see the wrong merge
            assert bad and r["errs"]["out"] > 1e-2, r
            assert r["volume"]["analytic"] == r["volume"]["counted"]
        else:
            assert not bad, (r["case"], r["seed"], bad)
            assert (
                r["volume"]["counted"] > 0 and len(r["errs"]) >= 6
            )  # out, input grad, wq, wk, wv, wo


def test_cp2_ring_and_ulysses_equal_one_device_and_a_wrong_merge_fails(tmp_path):
    assert_parity(run_cases(tmp_path, 2, n_random=3))


@pytest.mark.slow
def test_cp4_ring_and_ulysses_equal_one_device(tmp_path):
    assert_parity(run_cases(tmp_path, 4, n_random=3))
