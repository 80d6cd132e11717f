"""`python -m dtrain.run.selftest`: is distributed set-up healthy here?

Every rank all-reduces a tensor filled with rank+1 and checks the sum n(n+1)/2, the smallest
end-to-end proof that launcher, rendezvous and backend work. `fail_rank=K` makes rank K raise,
to see that a failure stops every rank and reaches the caller with its traceback. A healthy run
ends with a `selftest passed: ...` line. `work_s=S` keeps
the ranks all-reducing for about S seconds (rounds of all_reduce + 0.1 s sleep), so there is time to
interrupt, stop or kill something (tests/test_liveness.py).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtrain.core.errors import UserError
from dtrain.run.app import hydra_main
from dtrain.run.rank import RankContext


def validate(cfg) -> None:
    """fail_rank names a rank of this run (null: none fails); a rank that does not exist would make
    the run pass while the user asked to see a failure."""
    rank, n = cfg.fail_rank, cfg.world_size
    if rank is not None and not 0 <= rank < n:
        bound = f"< world_size={n}" if rank >= n else ">= 0"
        raise UserError(
            f"fail_rank={rank} must be {bound} (a rank, 0 to {n - 1}; or null: no rank fails)"
        )
    if cfg.numel < 1:
        raise UserError(f"numel={cfg.numel} must be an integer >= 1")
    if not 0 <= cfg.work_s < float("inf"):
        raise UserError(f"work_s={cfg.work_s} must be a finite number of seconds >= 0")


def rank_fn(ctx: RankContext) -> dict:
    if ctx.cfg.fail_rank is not None and ctx.rank == ctx.cfg.fail_rank:
        raise RuntimeError(
            f"selftest: rank {ctx.rank} fails on purpose (fail_rank={ctx.cfg.fail_rank})"
        )
    for _ in range(int(ctx.cfg.work_s / 0.1)):
        dist.all_reduce(torch.ones(1, device=ctx.device))
        time.sleep(0.1)
    x = torch.full((ctx.cfg.numel,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(x)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    wrong = int((x != expected).sum())
    ctx.writer.record(
        "allreduce_check", numel=ctx.cfg.numel, value=float(x[0]), expected=expected, wrong=wrong
    )
    if wrong:
        raise RuntimeError(f"all_reduce wrong on rank {ctx.rank}: {wrong} of {x.numel()} elements")
    return {
        "allreduce_sum": float(x[0]),
        "expected": expected,
        "backend": ctx.backend,
        "world_size": ctx.world_size,
    }


def finalize(run_dir, cfg, result: dict) -> dict:
    """The verdict, one line (a wrong sum or a failed rank never gets here: the run fails first)."""
    print(
        f"selftest passed: all_reduce over {result['world_size']} rank(s) ({result['backend']}) "
        f"summed to {result['allreduce_sum']:g} as expected: launcher, rendezvous and backend "
        "work here",
        flush=True,
    )
    return dict(result)


main = hydra_main(
    "dtrain.conf", rank_fn=rank_fn, validate=validate, config_name="selftest", finalize=finalize
)

if __name__ == "__main__":
    main()
