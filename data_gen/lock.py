"""One `specheads gen` at a time per output folder: an exclusive lock that a second run respects.

The lock is an `flock` on `OUT/.specheads-gen.lock`, so the kernel releases it when its holder ends, however it
ends (a killed run is resumed by the next one). The file names the holder, for the refusal.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from specheads.errors import UsageError

LOCK_FILE = ".specheads-gen.lock"


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold the folder's lock for the block; refuse at once, naming the holder, when another run holds it."""
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except ValueError:
                holder = {}
            raise UsageError(f"{out} is being written by another `specheads gen` (pid {holder.get('pid', '?')} on "
                             f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to finish, "
                             "or stop it, or choose another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
        handle.flush()
        yield
    finally:
        handle.close()  # closing the descriptor releases the lock
