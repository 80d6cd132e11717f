"""A write that found no room (disk full, quota, file-size limit), recognised wherever it surfaces.

It reaches us as a plain OSError (ENOSPC, EDQUOT, EFBIG), or wrapped: DCP puts each rank's error
in a `CheckpointException` (its `failures`), a handler's own error chains the first one
(__cause__, __context__), and a rank's error arrives in the launcher only as its traceback text.
torch's zip writer (caffe2/serialize/inline_container.cc, under every torch.save, DCP shards
included) loses the errno: a short write shows as `RuntimeError: [enforce fail at
inline_container.cc:N] . unexpected pos X vs Y` (the next write finds the stream short) or `...
file write failed`; only these two messages of that file are taken as a full disk.
"""

from __future__ import annotations

import errno
import os
import re
import resource

ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TEXT = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EFBIG: "File too large",
}
_TORCH_SHORT_WRITE = re.compile(
    r"inline_container\.cc:\d+\].*(unexpected pos \d+ vs \d+|file write failed)"
)
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
# the line that names an exception in a traceback ("OSError: [Errno 28] ...", "torch....Error: ...")
_EXC_LINE = re.compile(r"^(rank \d+: )?[A-Za-z_][\w.]*(Error|Exception)\b.*:")


def short_write_errno(path: str | os.PathLike | None = None) -> int:
    """What most likely cut torch's write short (it keeps no errno): EFBIG under a finite file-size
    limit (`ulimit -f`) when the disk still has room, else ENOSPC."""
    limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    if limited and path is not None:
        try:
            st = os.statvfs(path)
            limited = st.f_bavail * st.f_frsize > (16 << 20)
        except OSError:
            pass
    return errno.EFBIG if limited else errno.ENOSPC


def _wrapped(exc: BaseException) -> list:
    """What `exc` wraps: its cause, its context, DCP's failures ({rank: (error, stack)})."""
    inner = [exc.__cause__, exc.__context__]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        inner += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [e for e in inner if isinstance(e, BaseException)]


def find(exc: BaseException, path=None) -> OSError | None:
    """The OSError (ENOSPC, EDQUOT or EFBIG) `exc` is or wraps, or None when it is something else; a
    torch short write becomes one, naming `path` when given."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in ERRNOS:
            return e
        if isinstance(e, RuntimeError) and _TORCH_SHORT_WRITE.search(str(e)):
            code = short_write_errno(path)
            where = None if path is None else str(path)
            return OSError(code, f"{_TEXT[code]} (torch's writer was cut short)", where)
        todo += _wrapped(e)
    return None


def in_text(text: str) -> str | None:
    """The exception line of a forwarded traceback that says the disk was full (or the file too
    large), or None. Only exception lines count: a path or a log quoting 'Errno 28' does not."""
    for line in (s.strip() for s in reversed(text.splitlines())):
        if not _EXC_LINE.match(line):
            continue
        m = _ERRNO_IN_TEXT.search(line)
        if (
            (m and int(m.group(1)) in ERRNOS)
            or _TORCH_SHORT_WRITE.search(line)
            or any(f": {t}" in line for t in _TEXT.values())
        ):
            return line[:300]
    return None


def errno_in_text(line: str) -> int:
    """ENOSPC, EDQUOT or EFBIG for a line `in_text` returned."""
    m = _ERRNO_IN_TEXT.search(line)
    if m and int(m.group(1)) in ERRNOS:
        return int(m.group(1))
    return next((code for code, t in _TEXT.items() if t in line), None) or short_write_errno()


def message(code: int, cause: str, run_dir) -> str:
    """The error line (without `error: `) of a run stopped by a full disk or an oversized file."""
    left = f"incomplete run left (no summary.json) in {run_dir}"
    if code == errno.EFBIG:
        return (
            f"file too large ({cause}): raise the file-size limit (ulimit -f) or write to a "
            f"file system that allows larger files; {left}"
        )
    return f"disk full ({cause}): free space or pass results_dir=<a folder on another disk>; {left}"
