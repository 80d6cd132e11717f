"""A local sweep (`-m`, Hydra's basic launcher) runs every point, even after one fails.

Every point is checked before the sweep starts (dtrain.run.precheck); a point that still fails at
run time (a diverged loss, a rank that dies) prints its own `error:` line and leaves its failed run
directory, the following points run, and the sweep ends with one line naming the failed points and
exit code 1 (2 when every failure was bad input). An interrupt (exit 128+signal) ends the sweep.
Sweeps on Slurm (hydra/launcher=submitit_slurm) are left as they are: each point is its own job,
and `dtrain runs` lists the failed ones.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

_failed: list[tuple[str, int]] = []  # (which point, its exit code)
_ran = [0]


def in_local_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False
    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN and str(hc.launcher.get("_target_", "")).endswith(
        "BasicLauncher"
    )


def _this_point() -> str:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    return f"#{hc.job.num} ({' '.join(hc.overrides.task)})"


@contextlib.contextmanager
def point():
    """Around one point's run: in a local sweep, its failure is noted instead of ending the
    sweep."""
    if not in_local_sweep():
        yield
        return
    _ran[0] += 1
    try:
        yield
    except SystemExit as e:  # run_app has printed the point's error line
        code = e.code if isinstance(e.code, int) else 1
        if code == 0 or code >= 128:  # an interrupt stops the whole sweep
            raise
        _failed.append((_this_point(), code))
    except Exception:  # a bug: its traceback, then the next point
        traceback.print_exc()
        _failed.append((_this_point(), 1))


def finish() -> None:
    """After Hydra returns: one line naming the failed points, and the sweep's exit code."""
    if not _failed:
        return
    codes = {code for _, code in _failed}
    names = "; ".join(f"{where} exit {code}" for where, code in _failed)
    print(
        f"error: {len(_failed)} of {_ran[0]} sweep points failed ({names}); the others ran: see "
        "each point's error above and `dtrain runs --all`",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(2 if codes == {2} else 1)
