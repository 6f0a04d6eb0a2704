"""One writer at a time per output folder (`specheads gen`, `specheads eval`): an exclusive lock a second run respects.

`filelock.FileLock` holds an OS lock on `FOLDER/.specheads-<command>.lock` (flock on POSIX, msvcrt on Windows), so
the lock goes when its holder ends, however it ends, and a killed run is resumed by the next one. Where the OS lock
is not available (some network file systems), it falls back to `SoftFileLock`, whose file a killed run leaves behind
(the refusal then says to delete it). A second file beside the lock names the holder, for the refusal.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, SoftFileLock, Timeout

from specheads.plumbing.errors import UsageError


def lock_files(command: str) -> tuple[str, str]:
    """The names of `command`'s lock file and of the file naming its holder (`train drafter`: `train-drafter`)."""
    name = command.replace(" ", "-")
    return f".specheads-{name}.lock", f".specheads-{name}.holder"


@contextmanager
def folder_lock(folder: Path, command: str) -> Iterator[None]:
    """Hold `folder`'s lock for `command` for the block; refuse at once, naming the holder, when another run holds it.
    A block that ends refused (UsageError) takes away the lock's files it made, and the folder too when it made it."""
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock_name, holder_name = lock_files(command)
    fresh = not (folder / lock_name).exists() and not (folder / holder_name).exists()
    refused = False
    try:
        lock: FileLock | SoftFileLock = FileLock(folder / lock_name, timeout=0)
        lock.acquire()
    except NotImplementedError:  # no OS lock on this file system
        lock = SoftFileLock(folder / lock_name, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            _refuse(folder, command, holder_name, soft=True)
    except Timeout:
        _refuse(folder, command, holder_name, soft=False)
    try:
        (folder / holder_name).write_text(json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
        yield
    except UsageError:
        refused = True
        raise
    finally:
        lock.release()
        if created:
            forget_if_unused(folder, (lock_name, holder_name))
        elif fresh and refused:
            for name in (lock_name, holder_name):
                (folder / name).unlink(missing_ok=True)


def forget_if_unused(folder: Path, lock_names: tuple[str, str]) -> None:
    """Remove a folder the lock created when the run left nothing in it but the lock's files (it failed before
    writing anything): a refused run leaves nothing behind."""
    try:
        if all(path.name in lock_names for path in folder.iterdir()):
            for name in lock_names:
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
    except OSError:  # another run took the folder meanwhile; leave it
        pass


def _refuse(folder: Path, command: str, holder_name: str, soft: bool) -> None:
    try:
        holder = json.loads((folder / holder_name).read_text() or "{}")
    except (OSError, ValueError):
        holder = {}
    stale = (f"; if no such run is alive, delete {folder / lock_files(command)[0]} (this file system has no OS lock, "
             "so a killed run leaves it behind)") if soft else ""
    raise UsageError(f"{folder} is being written by another `specheads {command}` (pid {holder.get('pid', '?')} on "
                     f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to finish, or stop it, "
                     f"or choose another output folder{stale}")
