"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop) as one exception, `Interrupted`, raised in the main thread, so
that every command stops the same way: its `finally` blocks and Lightning's teardown run, and `specheads.cli.main`
exits 130 or 143 with one line saying how to resume.

Outside a Lightning Trainer the handler raises at once. While a Trainer runs (the callback
`specheads.plumbing.batch_end_stops.StopAtBatchEnds`) a stop is recorded and raised at the end of the batch
(`defer_stops`, `raise_pending`): an exception raised between any two bytecodes can leave a thread's lock or
condition half-updated (the TensorBoard writer's queue, whose thread's join then never returns), and a batch's end is
where no library holds one. Lightning 2.6 also records a SIGTERM itself and may raise `SIGTERMException` first, a
`SystemExit` that would read as success: `specheads.cli.main` reports it as the stop it is. On Ctrl-C Lightning
catches `KeyboardInterrupt` and exits 1; `Interrupted` is not one, so it passes through Lightning's teardown unchanged.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_depth = [0]  # how many `signals_raise` blocks this process is inside
_received: list[int] = []  # the stop signals the outermost block's handler took
_deferring = [0]  # how many Trainer runs in progress take a stop at a batch's end (`defer_stops`)
_pending: list[int] = []  # a stop taken while deferring and not raised yet


def received() -> int | None:
    """The stop signal this process's outermost `signals_raise` block raised `Interrupted` on, if any, even where a
    library's C code caught that exception and raised an error of its own instead (pyarrow does, mid-read)."""
    return _received[0] if _received else None


def defer_stops(on: bool) -> None:
    """From now (`on`) until the matching call with `on=False`, a stop signal is recorded, not raised: the next
    `raise_pending` raises it, or the outermost `signals_raise` block when it ends."""
    _deferring[0] = max(0, _deferring[0] + (1 if on else -1))


def raise_pending() -> None:
    """Raise `Interrupted` for the stop recorded while deferring, if one was; call it where no lock is held."""
    if _pending:
        raise Interrupted(_pending.pop())


def raising() -> bool:
    """Whether this process is inside a `signals_raise` block already (a command run by another, as the demo runs
    its stages): the outer one then reports the interruption."""
    return _depth[0] > 0


class Interrupted(BaseException):
    """The run was stopped by `signum` (SIGINT or SIGTERM). A BaseException, as KeyboardInterrupt is: no
    `except Exception` takes it for a failure of its own."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextmanager
def signals_raise() -> Iterator[None]:
    """For the block, SIGINT and SIGTERM raise `Interrupted` in this process's main thread; a second one ends the
    process at once, by the signal (the shell then reads the same code). Forked children (DataLoader workers) keep
    Python's own behaviour. The handlers found are put back after the block; off the main thread nothing changes."""
    if _depth[0] == 0:
        _received.clear()
        _pending.clear()
        _deferring[0] = 0
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner, raised = os.getpid(), []

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner or raised:
            if signum == signal.SIGINT and os.getpid() != owner:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raised.append(signum)
        _received.append(signum)
        if _deferring[0]:
            _pending.append(signum)
            return
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    _depth[0] += 1
    try:
        yield
        raise_pending()  # a stop that came during a Trainer's last batch
    finally:
        _depth[0] -= 1
        for signum, before in previous.items():
            signal.signal(signum, before if before is not None else signal.SIG_DFL)
