"""Values of the right type that cannot work, refused in the launching process before any rank
starts.

A key of the wrong type is Hydra's to refuse (dtrain.run.precheck); these are the right types with
impossible values (`train.beta1=1.5`, `model.init_std=nan`, `seed=-1`), paths that cannot hold a
run (empty, too long, a symlink loop, not writable) and datasets or checkpoints a rank would only
fail on (empty, odd-length, token ids beyond the vocab, a missing shard). Each is one UserError:
one `error:` line, exit 2, no run directory.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from pathlib import Path

from dtrain.core.errors import UserError, clip

MIN_HEARTBEAT_TIMEOUT_S = (
    2.0  # ranks beat every timeout/5 (>= 0.1 s); a busy host delays a beat by ~1 s
)
NAME_MAX, PATH_MAX = 255, 4096  # bytes, Linux
MAX_SEED = 2**63 - 1
SYNTHETIC_BRANCHING = 4  # dtrain.train.data.markov_corpus: successors per token


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def number_in(
    key: str,
    value,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> None:
    """`value` is a finite number in the interval (open ends where asked), else a UserError."""
    ok = (
        is_number(value)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    )
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        where = (
            f"> {low}"
            if high == math.inf and low_open
            else f">= {low}"
            if high == math.inf
            else f"in {lo}{low}, {high}{hi}"
        )
        raise UserError(f"{key}={value!r} must be a finite number {where}{hint}")


def integer_at_least(
    key: str,
    value,
    low: int,
    *,
    nullable: bool = False,
    high: int | None = None,
    error: type[Exception] = UserError,
) -> None:
    """`value` is an integer (not a bool) >= `low` (<= `high`; None too where `nullable`), else one
    line: `key=value must be an integer >= low`. `error` as in `one_of`."""
    if value is None and nullable:
        return
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        tail = f" and <= {high}" if high is not None else ""
        null = " or null" if nullable else ""
        raise error(f"{key}={value!r} must be an integer >= {low}{tail}{null}")


def one_of(key: str, value, choices, *, error: type[Exception] = UserError) -> None:
    """`value` is one of `choices`, else one line in the project's one form, e.g.
    `train.cp_impl='x' must be one of ring, ulysses, torch` (the value quoted, clipped when long).
    `error`: ValueError where a type refuses a value it was built with (not the user's input)."""
    if isinstance(value, str) and value in choices:  # the common case, in a hot loop of the search
        return
    # True == 1 in Python: a bool matches only a bool choice, a number only a number
    if not any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in choices):
        raise error(f"{key}={clip(repr(value))} must be one of {', '.join(map(str, choices))}")


# ---------------------------------------------------------------- paths


def check_path(key: str, value: str) -> None:
    """A folder a run will create (or write into): not empty, each name and the whole path within
    the filesystem's limits, no symlink loop or file on the way, and writable where it will be
    made."""
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{key}={value!r} is empty: pass {key}=<a folder>, e.g. {key}=results")
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError:
        raise UserError(
            f"{key}={value!r} cannot be encoded as a file name here: use ASCII characters"
        ) from None
    long = [n for n in raw.split(b"/") if len(n) > NAME_MAX]
    if long or len(os.fsencode(os.path.abspath(value))) >= PATH_MAX:
        what = f"a name of {len(long[0])} bytes" if long else "a path this long"
        raise UserError(
            f"{key}={value[:60]!r}... is too long ({what}; the filesystem allows {NAME_MAX} "
            f"per name, {PATH_MAX} in all): pass a shorter {key}"
        )
    _check_writable_below(key, value, Path(value), f"pass {key}=<a writable folder>")


def _check_writable_below(key: str, value, target: Path, fix: str) -> None:
    """Every existing part of `target` a folder (no file, no symlink loop on the way), and the
    deepest existing one writable: where `target` will be created."""
    existing = Path(".")
    for q in (*reversed(target.parents), target):  # the existing part, from the top
        try:
            os.stat(q)
        except FileNotFoundError:
            if os.path.islink(q):  # mkdir would say "File exists"
                raise UserError(
                    f"{key}={value!r} cannot be used: {q} is a dangling symlink (to "
                    f"{os.readlink(q)}): pass another {key} or fix the link"
                ) from None
            break
        except OSError as e:
            why = "a symlink loop" if e.errno == errno.ELOOP else e.strerror
            raise UserError(
                f"{key}={value!r} cannot be used: {q} is {why}: pass another {key}"
            ) from None
        if not os.path.isdir(q):
            raise UserError(
                f"{key}={value!r} cannot be used: {q} is a file, not a folder: pass another {key}"
            )
        existing = q
    try:  # access() says yes to root everywhere; only a real write tells
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as e:
        raise UserError(
            f"{key}={value!r} is not writable ({e.strerror} in {existing}): {fix}"
        ) from None


def check_output_file(key: str, value) -> Path:
    """A file a command writes after its work (a guide, a table), checked before that work so a path
    that cannot be written costs one line, not minutes and a traceback: not empty, not a folder, no
    file on the way, and its folder writable (created later when missing). Returns it as a Path."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise UserError(f"{key}={value!r} is empty: pass {key}=<a file>")
    path = Path(value)
    if path.is_dir():
        raise UserError(
            f"{key}={str(value)!r} is a folder, not a file: pass a file path, "
            f"e.g. {key}={path / 'GUIDE.md'}"
        )
    _check_writable_below(key, str(value), path.parent, f"pass {key}=<a file in a writable folder>")
    return path


# ---------------------------------------------------------------- shared keys


def check_base_values(cfg) -> None:
    """The shared keys of dtrain.core.nodes.BaseConfig that have the right type but cannot work."""
    check_path("results_dir", cfg.results_dir)
    number_in("dist_timeout_s", cfg.dist_timeout_s, 0, low_open=True)
    hb = cfg.get("heartbeat_timeout_s")
    if hb is not None and not (is_number(hb) and MIN_HEARTBEAT_TIMEOUT_S <= hb < math.inf):
        raise UserError(
            f"heartbeat_timeout_s={hb!r} must be a number of seconds >= "
            f"{MIN_HEARTBEAT_TIMEOUT_S:g} (ranks beat every timeout/5; below that healthy ranks "
            "look hung), or null to turn it off"
        )
    integer_at_least("seed", cfg.seed, 0, high=MAX_SEED)
    integer_at_least("threads_per_rank", cfg.get("threads_per_rank"), 1, nullable=True)


def check_model_values(model) -> None:
    """A dtrain.model.args.GPTConfig's values that build but cannot train."""
    integer_at_least("model.vocab_size", model.vocab_size, 2, high=65536)  # tokens are uint16
    number_in("model.init_std", model.init_std, 0, low_open=True)


def check_train_values(train) -> None:
    """A TrainConfig's optimizer and schedule values: finite, and where AdamW needs them."""
    number_in("train.lr", train.lr, 0, low_open=True)
    number_in("train.min_lr", train.min_lr, 0)
    number_in("train.weight_decay", train.weight_decay, 0)
    for key in ("beta1", "beta2"):
        number_in(f"train.{key}", getattr(train, key), 0, 1, high_open=True)
    if train.grad_clip is not None:
        number_in("train.grad_clip", train.grad_clip, 0, low_open=True, hint=" or null")
    integer_at_least("train.keep_checkpoints", train.keep_checkpoints, 1, nullable=True)


# ---------------------------------------------------------------- data


def _dataset_error(path: str, what: str, fix: str) -> UserError:
    return UserError(f"train.dataset={path!r} {what}: {fix}")


def check_training_data(train, model) -> None:
    """What a rank would find only when it reads the data: an empty, odd-length, too short or
    unreadable file, token ids the model's vocabulary does not have."""
    need = model.seq_len + 1  # one (input, target) window
    if train.dataset == "synthetic":
        if model.vocab_size < SYNTHETIC_BRANCHING:
            raise UserError(
                f"model.vocab_size={model.vocab_size} is too small for train.dataset=synthetic "
                f"(each token has {SYNTHETIC_BRANCHING} successors): pass model.vocab_size >= "
                f"{SYNTHETIC_BRANCHING}"
            )
        if train.dataset_tokens < need:
            raise UserError(
                f"train.dataset_tokens={train.dataset_tokens} is less than model.seq_len + 1 = "
                f"{need}: raise train.dataset_tokens"
            )
        return
    path = train.dataset
    try:
        with open(path, "rb") as f:
            f.read(1)
        size = os.path.getsize(path)
    except OSError as e:
        raise _dataset_error(
            path, f"cannot be read ({e.strerror})", "fix its permissions or pass another file"
        ) from None
    if path.endswith(".bin"):
        if size == 0 or size % 2:
            raise _dataset_error(
                path,
                f"is {size} bytes: a nanoGPT .bin holds 2-byte (uint16) tokens, so it is "
                f"{'empty' if size == 0 else 'truncated (odd length)'}",
                "regenerate it, or pass a text file (read as bytes)",
            )
        tokens = size // 2
        if tokens < need:
            raise _dataset_error(
                path,
                f"holds {tokens} tokens, fewer than model.seq_len + 1 = {need}",
                "pass a larger file or a smaller model.seq_len",
            )
        import numpy as np

        top = int(np.memmap(path, dtype="<u2", mode="r").max())
        if top >= model.vocab_size:
            raise _dataset_error(
                path,
                f"has token id {top}, beyond model.vocab_size={model.vocab_size}",
                f"pass model.vocab_size >= {top + 1}",
            )
        return
    if size < need:
        raise _dataset_error(
            path,
            f"is {size} bytes, fewer tokens than model.seq_len + 1 = {need} (read as bytes)",
            "pass a larger file or a smaller model.seq_len",
        )
    if model.vocab_size < 256:
        raise _dataset_error(
            path,
            f"is read as bytes (token ids up to 255) but model.vocab_size={model.vocab_size}",
            "pass model.vocab_size >= 256, or a .bin token file",
        )
