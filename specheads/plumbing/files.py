"""Writes that a reader never sees half done: a temporary file beside the target, then one rename; and the
permissions a published file or folder should carry."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from specheads.plumbing.errors import UsageError

KINDS = ((stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO (named pipe)"),
         (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def path_kind(path: Path) -> str | None:
    """What is at `path`, a final symbolic link not followed: None when nothing is, `file` for a regular file, else
    `folder`, `symbolic link`, `FIFO (named pipe)`, `socket`, `character device` or `block device`."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return "file"
    return next((kind for test, kind in KINDS if test(mode)), "special file")


def check_output_file(path: Path, flag: str = "--out") -> None:
    """Refuse, before anything runs, an output file that exists and is not a regular file (a folder, a symbolic link,
    a FIFO, a device: the rename that publishes the file would replace it), or whose folder cannot be written."""
    path = Path(path)
    kind = path_kind(path)
    if kind == "folder":
        raise UsageError(f"{flag} {path} is a folder; give the path of the file to write, e.g. {path / 'out.json'}")
    if kind not in (None, "file"):
        raise UsageError(f"{flag} {path} is a {kind}, not a regular file, and writing would replace it; give the path "
                         "of a regular file (or of one that does not exist yet)")
    check_output_folder(path.parent, f"{flag}'s folder")


def check_output_files(folder: Path, names: Iterable[str], flag: str = "--out") -> None:
    """Refuse an output folder where a file the command writes (`names`, relative to it) exists as something other
    than a regular file, which publishing the file would replace."""
    for name in names:
        kind = path_kind(Path(folder) / name)
        if kind not in (None, "file"):
            raise UsageError(f"{flag} {folder} holds {name} as a {kind}, not a regular file, and writing the report would "
                             f"replace it; move it away, or choose another {flag}")


def check_output_folder(folder: Path, flag: str = "--out", replaced: bool = False) -> None:
    """Refuse, before anything runs, an output folder that cannot be written: something other than a folder where
    the folder or one of its parents should be (or, where the command `replaced` the folder whole, a symbolic link,
    which the new folder would replace), or a folder (or the nearest existing parent it would be made in) that this
    process may not write to (permissions, a read-only file system, a virtual file system such as /proc): a
    temporary file is made there to know."""
    folder = Path(folder)
    kind = path_kind(folder)
    if kind == "symbolic link" and (replaced or not folder.is_dir()):
        raise UsageError(f"{flag} {folder} is a symbolic link, which the new folder would replace; give the folder it "
                         f"points to ({os.path.realpath(folder)}) or another path")
    if kind not in (None, "folder", "symbolic link"):
        what = "a file" if kind == "file" else f"a {kind}"
        raise UsageError(f"{flag} {folder} is {what}, not a folder; give a folder path (it is made when missing)")
    existing = folder.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {folder} cannot be made: {existing} is a file, not a folder; give a path under a "
                         "folder")
    where = "" if existing == folder.absolute() else f" (its parent {existing}, where it would be made)"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {folder} is not writable{where}: permission denied or a read-only file system; "
                         "choose a folder you can write to, or fix its permissions")
    try:  # an unnamed file where the system allows (O_TMPFILE): no other process sees it in the folder
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise UsageError(f"{flag} {folder} is not writable{where}: making a file there failed ({error.strerror or error}); "
                         "choose a folder you can write to") from None


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
    """A temporary path beside `final`, moved onto it when the block ends without error (else removed); refused when
    `final` exists and is not a regular file (a folder, a link, a FIFO, a device), which the move would replace."""
    kind = path_kind(final)
    if kind not in (None, "file"):
        raise UsageError(f"{final} is a {kind}, not a regular file, and writing would replace it; move it away, or "
                         "choose another output path")
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
