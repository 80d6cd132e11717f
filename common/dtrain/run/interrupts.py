"""SIGINT/SIGTERM on the launching process: `catch_interrupts` turns them into `Interrupted`, so
the launcher stops its ranks and exits 128+signal; `deferred_interrupts` holds them while a
clean-up that must finish runs."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher; a BaseException so no `except Exception` swallows
    it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM


@contextlib.contextmanager
def _interrupt_handler(handler):
    """`handler` for SIGINT/SIGTERM while inside (main thread only; elsewhere nothing changes). A
    signal ignored on purpose (`cmd &` in a script ignores SIGINT) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {
        s: signal.signal(s, handler)
        for s in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def catch_interrupts():
    """SIGINT/SIGTERM raise `Interrupted` in the main thread while inside (launching process
    only)."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    return _interrupt_handler(handler)


@contextlib.contextmanager
def deferred_interrupts():
    """Clean-up that must finish (kill the ranks, remove the temp folder): SIGINT/SIGTERM
    arriving meanwhile (a second Ctrl-C) are noted, then raised as `Interrupted` once it is done.
    A handler, not a signal mask: the kernel may hand the signal to any thread, and Python runs
    handlers in the main thread."""
    caught: list[int] = []
    with _interrupt_handler(lambda signum, _frame: caught.append(signum)):
        yield
    if caught:
        raise Interrupted(caught[0])
