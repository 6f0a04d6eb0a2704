"""Writes that a reader never sees half done: a temporary file beside the target, then one rename; and the
permissions a published file or folder should carry."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specheads.plumbing.errors import UsageError


def check_output_folder(folder: Path, flag: str = "--out") -> None:
    """Refuse, before anything runs, an output folder that cannot be written: a file where the folder or one of its
    parents should be, or a folder (or the nearest existing parent it would be made in) that this process may not
    write to (permissions, a read-only file system)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file, not a folder; give a folder path (it is made when missing)")
    existing = folder.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {folder} cannot be made: {existing} is a file, not a folder; give a path under a "
                         "folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == folder.absolute() else f" (its parent {existing}, where it would be made)"
        raise UsageError(f"{flag} {folder} is not writable{where}: permission denied or a read-only file system; "
                         "choose a folder you can write to, or fix its permissions")


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def publish(temporary: str, final: Path) -> None:
    """Give a finished temporary file the usual permissions and move it into place atomically."""
    os.chmod(temporary, 0o666 & ~current_umask())
    os.replace(temporary, final)


def usual_permissions(folder: Path) -> None:
    """Give a folder built in a private temporary directory (mkdtemp's 0700), and everything in it, the permissions
    a plain mkdir and open would have given under the umask, so that others can read what is published."""
    umask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_path(final: Path) -> Iterator[str]:
    """A temporary path beside `final`, moved onto it when the block ends without error (else removed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(handle)
    try:
        yield temporary
        publish(temporary, final)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON via a temporary file and a rename."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text via a temporary file and a rename."""
    with atomic_path(path) as temporary:
        Path(temporary).write_text(text, encoding="utf-8")


RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_folders(first: Path, second: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 RENAME_EXCHANGE, which Python does not wrap): a reader sees
    one or the other, never neither. False where the system cannot, and nothing moved."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_cwd = -100  # AT_FDCWD
    done = renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), RENAME_EXCHANGE)
    return done == 0


def replace_folder(new: Path, out: Path) -> None:
    """Put the finished folder `new` where `out` is (same file system): swapped in one step where the system allows,
    else by two renames with the old folder kept beside until the new one is in place."""
    if not out.exists():
        new.rename(out)
        return
    if exchange_folders(new, out):
        shutil.rmtree(new)  # now the old folder
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    out.rename(aside / out.name)
    new.rename(out)
    shutil.rmtree(aside)
