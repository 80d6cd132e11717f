"""The top of every subproject: Hydra config in, run directory out.

    main = hydra_main("tp_attention.conf", rank_fn=..., validate=..., finalize=...)

`validate(cfg)` checks the subproject's own keys before anything starts; `rank_fn(ctx)` runs on
every rank; `finalize(run_dir, cfg, result)` runs once after all ranks finished (plots, tables)
and returns the summary. `summary.json` is written last. A `UserError` anywhere becomes one line
on stderr, exit code 2, and no run directory; any other failure leaves the run directory without
a summary (so loaders skip it) and exits 1 with the failing rank's traceback (a full disk: one
line and a `run_failed` event instead). SIGINT/SIGTERM on the launching process stop every rank
(or cancel the Slurm job), record `run_failed` and exit 128+signal (130 for Ctrl-C, 143 for
SIGTERM) with one `error: interrupted ...` line. The launching process claims its run directory
(dtrain.run.rundir), so two runs never write into one; overrides and, in a sweep, every point are
checked before Hydra starts (dtrain.run.precheck).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from dtrain.core import checks, diskfull
from dtrain.core.errors import UserError, fail
from dtrain.results.metrics import RunWriter, write_summary
from dtrain.run import dist as ddist
from dtrain.run import local_sweep, requeue, rundir
from dtrain.run.interrupts import Interrupted, catch_interrupts
from dtrain.run.launch import LAUNCHERS, launch, mode_of
from dtrain.run.rank_failure import JobEnded, RankFailed
from dtrain.run.rundir import RunDirTaken, claim
from dtrain.slurm import submitit_sweep

Finalize = Callable[[Path, DictConfig, Any], dict]


def check_base(cfg: DictConfig, devices: bool = True) -> None:
    """The shared keys, checked before any process starts; ``devices``: also this host's device
    and backend for a local run (the one check that imports torch: the command-line check runs it
    last)."""
    if cfg.launcher not in LAUNCHERS:
        raise UserError(f"launcher={cfg.launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if (
        not isinstance(cfg.world_size, int)
        or isinstance(cfg.world_size, bool)
        or cfg.world_size < 1
    ):
        raise UserError(f"world_size={cfg.world_size!r} must be an integer >= 1")
    checks.check_base_values(
        cfg
    )  # results_dir, timeouts, seed, threads: right type, impossible value
    rundir.check_results_folder(cfg)  # <results_dir>/<subproject> a file: not Hydra's traceback
    if cfg.backend not in ddist.BACKENDS:
        raise UserError(f"backend={cfg.backend!r} is not one of {', '.join(ddist.BACKENDS)}")
    if cfg.launcher == "slurm":
        check_signal_delay(cfg.slurm)
    if devices:
        check_devices(cfg)


def check_devices(cfg: DictConfig) -> None:
    if mode_of(cfg) == "local":  # on Slurm the compute nodes, not this host, must have the GPUs
        ddist.pick_backend(cfg.backend, ddist.pick_device(cfg.device, 0))


def resolve(ref):
    """A callable, or a "module:attribute" reference to one, imported when first needed: an entry
    point names its rank code this way, so a wrong command line is refused before torch and the
    rank code are imported."""
    if not isinstance(ref, str):
        return ref
    import importlib

    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


# USR2 must come after submitit has installed its handler in every task (python started, the task
# unpickled: ~10-20 s here); before that USR2's default action ends the task, and the job is lost.
MIN_SECONDS_BEFORE_USR2 = 30
# sbatch --signal: "Due to the resolution of event handling by Slurm, the signal may be sent up to
# 60 seconds earlier than specified" (slurmctld checks time limits periodically).
SLURM_SIGNAL_EARLY_S = 60


def check_signal_delay(s: DictConfig) -> None:
    """USR2 may come signal_delay_s + 60 s before the limit: even then the tasks must be ready."""
    delay, minutes = (
        s.signal_delay_s,
        s.time_min,
    )  # the defaults live in dtrain.core.nodes.SlurmConfig
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
        raise UserError(f"slurm.signal_delay_s={delay!r} must be an integer number of seconds >= 1")
    need_s = delay + SLURM_SIGNAL_EARLY_S + MIN_SECONDS_BEFORE_USR2
    if not isinstance(minutes, int) or isinstance(minutes, bool) or minutes * 60 < need_s:
        least = -(-need_s // 60)
        why = (
            f"Slurm sends USR2 slurm.signal_delay_s={delay} s before the limit and up to "
            f"{SLURM_SIGNAL_EARLY_S} s earlier (sbatch --signal), and the tasks need "
            f"{MIN_SECONDS_BEFORE_USR2} s for submitit's handler"
        )
        lower = minutes * 60 - (need_s - delay) if isinstance(minutes, int) else 0
        fix = f"pass slurm.time_min={least} or more" + (
            f", or lower slurm.signal_delay_s to <= {lower}" if lower >= 1 else ""
        )
        raise UserError(f"slurm.time_min={minutes!r} must be >= {least} minutes: {why}: {fix}")


def run_dir_for(cfg: DictConfig) -> Path:
    """Hydra's output dir when under Hydra (runs and sweeps), else
    results_dir/subproject/timestamp."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.results_dir) / cfg.subproject / datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe.{os.getpid()}"  # per process: ranks of a job share the dir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"results path {str(path)!r} is not writable ({e.strerror}): "
            "pass results_dir=<a writable folder>"
        ) from None


DISK_FULL = diskfull.ERRNOS  # ENOSPC, EDQUOT, EFBIG


def disk_full(run_dir: Path, cause: str, code: int = errno.ENOSPC) -> None:
    """Out of space (or over the file-size limit): one line, a run_failed event if it still fits, no
    stray temporary files; exits 1."""
    for tmp in Path(run_dir).glob(".*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    _record_failure(run_dir, f"{'file too large' if code == errno.EFBIG else 'disk full'}: {cause}")
    fail(diskfull.message(code, cause, run_dir), 1)


def _guard_hydra_writes() -> None:
    """Hydra writes a run's .hydra/ files itself, before the task runs, and reports an error there
    as a traceback (exit 1); a full disk or a file-size limit there is one line, as at any other
    write. Hydra has no hook before those writes, so its writer is wrapped."""
    import hydra.core.utils as hydra_utils

    save = hydra_utils._save_config
    if getattr(save, "dtrain_guarded", False):
        return

    def guarded(cfg, filename: str, output_dir: Path) -> None:
        try:
            save(cfg, filename, output_dir)
        except OSError as e:
            if e.errno not in diskfull.ERRNOS:
                raise
            where = Path(output_dir) / filename
            disk_full(Path(output_dir).parent, f"{e.strerror}: {where}", e.errno)  # exits 1

    guarded.dtrain_guarded = True
    hydra_utils._save_config = guarded


def _checkpoint_dir(cfg: DictConfig) -> Path | None:
    """An explicit train.checkpoint_dir: a folder outside the run dir that the run must own too."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, "train.checkpoint_dir", default=None)
    return Path(os.path.abspath(value)) if value else None


def _check_ownership(cfg: DictConfig, run_dir: Path, ckpt: Path | None) -> None:
    """Before anything is written: the run dir, results_dir and an explicit checkpoint dir are not
    (inside) another run's folder, and a resume does not read a run still writing checkpoints."""
    from omegaconf import OmegaConf

    rundir.check_outside_runs(f"run directory {run_dir}", run_dir, "hydra.run.dir", False)
    rundir.check_outside_runs(
        f"results_dir={cfg.results_dir}", cfg.results_dir, "results_dir", own=run_dir
    )
    if ckpt is not None:
        value = OmegaConf.select(cfg, "train.checkpoint_dir")
        if os.path.realpath(ckpt) == os.path.realpath(run_dir):
            raise UserError(
                f"train.checkpoint_dir={value} is the run directory itself: leave it "
                f"unset (checkpoints go to {value}/checkpoints) or pass another folder"
            )
        rundir.check_outside_runs(
            f"train.checkpoint_dir={value}", ckpt, "train.checkpoint_dir", False, run_dir
        )  # the folder itself: claim_folder names its run
        checks.check_path("train.checkpoint_dir", str(ckpt))  # a file, a symlink loop: one line
    resume = OmegaConf.select(cfg, "train.resume_from", default=None)
    if resume:
        rundir.check_not_running("train.resume_from", resume)


def run_app(
    cfg: DictConfig,
    *,
    rank_fn,
    validate: Callable[[DictConfig], None] | None = None,
    finalize: Finalize | None = None,
) -> dict | None:
    run_dir = run_dir_for(
        cfg
    )  # under Hydra it exists already; on bad input only what this run made is removed
    requeue.exit_if_complete(run_dir)  # `scontrol requeue` of a finished job: nothing touched
    rundir.remember(run_dir)  # a no-op when Hydra's callback already saw it before creating it
    job = ddist.detect_job(cfg.launcher)
    is_launcher = job is None or job.rank == 0
    claimed, ckpt, ckpt_created, finalizing = False, _checkpoint_dir(cfg), None, False
    # In a job (torchrun, Slurm task) the job's launcher owns the signals; here we do.
    interrupts = contextlib.ExitStack()
    if job is None:
        interrupts.enter_context(catch_interrupts())
    try:
        check_base(cfg)
        if is_launcher:
            _check_ownership(cfg, run_dir, ckpt)  # before validate reads a live run's files
        if validate:
            validate(cfg)
        check_writable(run_dir)
        if is_launcher:  # in a job, rank 0's directory is the run's (the others' are dropped)
            claimed = bool(claim(run_dir))
            if ckpt is not None and ckpt != run_dir / "checkpoints":
                ckpt_created = rundir.claim_folder(
                    ckpt, "train.checkpoint_dir", run_dir, " (train.resume_from may still read it)"
                )
        result, run_dir = launch(rank_fn, cfg, run_dir)
        if job is not None and job.rank != 0:
            return None  # rank 0 of the job finalizes
        finalizing = True
        summary = finalize(run_dir, cfg, result) if finalize else dict(result or {})
        summary = {
            "subproject": cfg.subproject,
            "run_dir": str(run_dir),
            "status": "complete",
            **summary,
        }
        write_summary(run_dir, summary)
    except RunDirTaken as e:
        fail(str(e), 2)  # another run's directory: leave it as it is
    except UserError as e:
        if is_launcher and not finalizing:
            if ckpt_created is not None:  # claimed by this run: undo it
                rundir.release_folder(ckpt, ckpt_created)
            rundir.discard(
                run_dir, claimed
            )  # bad input leaves no results behind, and nothing else touched
        if finalizing:
            _record_failure(run_dir, f"finalize: {e}")
        fail(str(e), 2)
    except OSError as e:
        full = diskfull.find(e)
        if full is None:
            if not finalizing:
                raise
            _finalize_crashed(run_dir)
        disk_full(run_dir, f"{full.strerror}: {full.filename or run_dir}", full.errno)
    except JobEnded as e:  # scancel, or the time limit past slurm.max_requeues: one line, no dump
        with contextlib.suppress(OSError), RunWriter(run_dir) as w:
            w.event("run_failed", error=str(e), reason=e.reason)
        fix = f"; {e.fix}" if e.fix else ""
        fail(f"{e}: run_failed recorded in {run_dir}/events.jsonl{fix}", 1)
    except RankFailed as e:
        full = diskfull.in_text(str(e)) or diskfull.in_text(e.error or "")  # a rank's traceback
        if full:
            disk_full(run_dir, full, diskfull.errno_in_text(full))  # exits
        _record_failure(run_dir, e.error or str(e))  # the root cause's one line; never raises
        print(str(e), file=sys.stderr, flush=True)
        fail(f"run failed; incomplete run left (no summary.json) in {run_dir}", 1)
    except Interrupted as e:
        with contextlib.suppress(OSError), RunWriter(run_dir) as w:
            w.event("run_failed", error=str(e))
        fail(
            f"{e}: ranks stopped, run_failed recorded in {run_dir}/events.jsonl (no summary.json)",
            e.exit_code,
        )
    except Exception as e:
        full = diskfull.find(e, run_dir)  # wrapped: a plotting library's error, torch's short write
        if full is not None:
            disk_full(run_dir, f"{full.strerror}: {full.filename or run_dir}", full.errno)
        if not finalizing:
            raise
        _finalize_crashed(run_dir)
    finally:
        interrupts.close()
    print(f"run complete: {run_dir}  (summary.json written)", flush=True)
    return summary


def _record_failure(run_dir: Path, error: str) -> None:
    with contextlib.suppress(OSError), RunWriter(run_dir) as w:
        w.event("run_failed", error=error[:500])


def _finalize_crashed(run_dir: Path) -> None:
    """Every rank finished but the summary could not be made: a failed run, said as one (exits
    1)."""
    from dtrain.run.rank_failure import error_line

    text = traceback.format_exc()
    error = f"finalize: {error_line(text)}"
    _record_failure(run_dir, error)
    print(text, file=sys.stderr, end="", flush=True)
    fail(
        f"run failed after training ({error}); incomplete run left (no summary.json) in {run_dir}",
        1,
    )


def hydra_main(
    config_module: str, *, rank_fn, validate=None, finalize=None, config_name: str = "config"
):
    """A console-script-ready `main()` for a subproject whose YAML lives in `config_module`;
    ``rank_fn``, ``validate`` and ``finalize`` are callables or "module:attribute" references
    (``resolve``)."""
    import importlib

    import hydra

    from dtrain.run import hydra_argv, precheck, precheck_dirs, precheck_job

    importlib.import_module(config_module)  # registers its typed config in Hydra's ConfigStore

    def validate_point(cfg: DictConfig) -> None:  # what run_app checks, for every point of a sweep
        check_base(cfg, devices=False)
        if validate:
            resolve(validate)(cfg)
        check_devices(cfg)

    @hydra.main(config_path=f"pkg://{config_module}", config_name=config_name, version_base="1.3")
    def _hydra_entry(cfg: DictConfig) -> None:
        with local_sweep.point():  # in a local sweep a failed point is noted and the next one runs
            run_app(
                cfg,
                rank_fn=resolve(rank_fn),
                validate=resolve(validate),
                finalize=resolve(finalize),
            )

    def main() -> None:
        argv = sys.argv[1:]
        try:
            precheck_dirs.check_literal_paths(argv)  # before Hydra creates a folder from them
            job = ddist.detect_job(hydra_argv.literal_override(argv, "launcher"))
            precheck_job.check_job_size(argv, job)
            if job is None or job.rank == 0:  # ranks > 0 of a job never claim (rank 0's dir wins)
                precheck_dirs.check_run_dirs(argv)
            precheck.check_overrides(config_module, config_name, argv, validate_point)
        except UserError as e:
            fail(str(e), 2)
        except KeyboardInterrupt:  # before Hydra: nothing was written yet
            fail("interrupted before the run started; nothing written", 130)
        precheck_job.note_job_environment(argv, job)
        submitit_sweep.install(
            sys.argv[1:]
        )  # a submitit sweep: one line when sbatch refuses, run dirs when done
        _guard_hydra_writes()
        _hydra_entry()
        local_sweep.finish()

    def check(
        argv: list[str],
    ) -> None:  # the checks main() runs before Hydra starts, for tests and tools
        precheck.check_overrides(config_module, config_name, argv, validate_point)

    main.check = check
    return main
