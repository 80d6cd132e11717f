"""Writers for the run-directory contract (docs/ARCHITECTURE.md):

config.yaml    resolved config                 (rank 0)
env.json       host, versions, devices         (rank 0)
records.jsonl  one JSON object per measurement (rank 0; other ranks to records.rank<N>.jsonl when
asked)
events.jsonl   discrete events                 (rank 0; other ranks to events.rank<N>.jsonl)
summary.json   written last and atomically: its presence means the run completed
tb/<name>/     TensorBoard event files of the numbers a run plots (rank 0, `RunWriter.scalar`);
               <name> is the run's overrides (`run_name`), so `tensorboard --logdir results`
               tells sweep points apart
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
CONFIG = "config.yaml"
ENV = "env.json"
RECORDS = "records.jsonl"
EVENTS = "events.jsonl"
TENSORBOARD = "tb"
OVERRIDES = ".hydra/overrides.yaml"  # the command line's overrides, as Hydra saved them
# overrides that say where a run is written, not what it runs: left out of its name
_WHERE = ("hydra", "results_dir")
NAME_LIMIT = 120  # characters of a TensorBoard run folder's name (a file name holds 255 bytes)


def _jsonable(x: Any) -> Any:
    """numpy / torch scalars and paths into plain JSON values."""
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def strict(obj: Any) -> Any:
    """A copy that is valid JSON: NaN/Inf become null (json.dump would write the non-standard NaN
    literals, which strict readers such as jq or JavaScript reject)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    try:
        return strict(_jsonable(obj))
    except TypeError:
        return obj  # json.dump's default reports it


def dumps(obj: Any) -> str:
    return json.dumps(strict(obj), default=_jsonable, sort_keys=False, allow_nan=False)


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """tmp + rename, so a reader never sees half a file (and a crash leaves none). Mode 0666 less
    the umask, like every other file of the run (mkstemp's 0600 would hide it from other users)."""
    path = Path(path)
    tmp = path.with_name(
        f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    )  # unique: ranks share the dir
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(strict(obj), f, default=_jsonable, indent=2, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written .tmp behind
        raise
    return path


def write_config(run_dir: Path, cfg) -> Path:
    from omegaconf import OmegaConf

    return write_text_atomic(Path(run_dir) / CONFIG, OmegaConf.to_yaml(cfg, resolve=True))


def write_summary(run_dir: Path, summary: dict) -> Path:
    """summary.json; its "guide_inputs", when a list of dtrain.results.contract records, encoded
    and checked."""
    from dtrain.results import contract

    if isinstance(summary.get(contract.KEY), (list, tuple)):
        summary = {**summary, contract.KEY: contract.encode(summary[contract.KEY])}
    if contract.KEY in summary:
        contract.decode(
            strict(summary[contract.KEY])
        )  # what a reader will get back, or ContractError now
    return write_json_atomic(Path(run_dir) / SUMMARY, summary)


def finite_or_none(x: float | None) -> float | None:
    """NaN/Inf are not JSON; records keep them as null plus an event elsewhere."""
    return None if x is None or not math.isfinite(x) else float(x)


def run_overrides(run_dir: str | Path) -> list[str]:
    """The overrides a run was started with (Hydra's `.hydra/overrides.yaml`), those that only say
    where it is written (hydra.*, results_dir) left out; [] when there is none (a derived run)."""
    import yaml

    try:
        found = yaml.safe_load((Path(run_dir) / OVERRIDES).read_text())
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(found, list):
        return []
    return [str(o) for o in found if not str(o).lstrip("+~").startswith(_WHERE)]


def run_name(run_dir: str | Path) -> str:
    """A run's overrides as one folder name (`train.strategy=zero3,world_size=4`), or `defaults`."""
    name = ",".join(run_overrides(run_dir)).replace(os.sep, "%") or "defaults"
    if len(name) <= NAME_LIMIT:
        return name
    import hashlib  # the same long command line, the same name: a requeued run continues its own

    return f"{name[: NAME_LIMIT - 11]}...{hashlib.sha1(name.encode()).hexdigest()[:8]}"


class RunWriter:
    """Appends records and events for one rank, a whole line per write: a crash loses at most a
    line, a full disk leaves none torn. `scalar` also shows a number in TensorBoard."""

    def __init__(self, run_dir: str | Path, rank: int = 0, per_rank_records: bool = False):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.per_rank_records = per_rank_records
        self._files: dict[str, Any] = {}
        self._tb: Any = None  # the SummaryWriter, made at the first scalar; False: no tensorboard

    def _append(self, name: str, obj: dict) -> None:
        f = self._files.get(name)
        if f is None:  # unbuffered: each line is written whole at once, nothing waits in a buffer
            f = self._files[name] = open(self.run_dir / name, "ab", buffering=0)
        line = memoryview((dumps(obj) + "\n").encode())
        start = os.fstat(f.fileno()).st_size
        try:
            while line:
                n = f.write(line)  # short only when the disk (or the file-size limit) is reached
                if not n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / name))
                line = line[n:]
        except OSError:
            with contextlib.suppress(OSError):  # a full disk leaves no torn line for readers
                os.ftruncate(f.fileno(), start)
            raise

    def _name(self, base: str) -> str:
        return base if self.rank == 0 else base.replace(".jsonl", f".rank{self.rank}.jsonl")

    def record(self, kind: str, **values) -> None:
        """A measurement. Rank 0 always writes; other ranks only with per_rank_records."""
        if self.rank == 0 or self.per_rank_records:
            self._append(self._name(RECORDS), {"kind": kind, **values})

    def event(self, kind: str, **values) -> None:
        """A discrete event (NaN, skipped step, alert, ...); every rank writes its own."""
        self._append(self._name(EVENTS), {"kind": kind, "rank": self.rank, **values})

    def scalar(self, tag: str, value: Any, step: int) -> None:
        """`value` at `step` under `tag` (`train/loss`) in this run's TensorBoard events (rank 0);
        a value that is not a finite number (None, a NaN loss, a bool) is left out, as records
        hold null for it."""
        if self.rank != 0 or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if math.isfinite(value) and (tb := self._tensorboard(step)) is not None:
            tb.add_scalar(tag, value, step)

    def scalars(self, group: str, step: int, **values) -> None:
        """Each of `values` as `<group>/<name>` at `step`."""
        for name, value in values.items():
            self.scalar(f"{group}/{name}", value, step)

    def _tensorboard(self, first_step: int):
        """The event writer, made at the first scalar (runs that plot nothing import nothing).
        purge_step: a requeued run starts again at `first_step`, and TensorBoard drops what an
        earlier attempt wrote from there on, as the records are cut back. Without tensorboard
        (an optional dependency) one event says so and nothing else happens."""
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                self._tb = False
                self.event("tensorboard_unavailable", reason=f"{e}: pip install -e '.[dashboard]'")
                return None
            self._tb = SummaryWriter(
                str(self.run_dir / TENSORBOARD / run_name(self.run_dir)),
                purge_step=first_step,
                flush_secs=10,
            )
            self._tb.add_text("overrides", " ".join(run_overrides(self.run_dir)) or "(none)")
        return self._tb or None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb:
            self._tb.close()
        self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
