"""What keeps `specheads export` inside its folders: inputs it copies hold only regular files and folders, names read
from an input resolve inside it, `--out` never holds an input it would delete, tensors written are finite, one export
at a time per `--out`, and an interrupted export leaves nothing behind (SIGTERM and Ctrl-C raise in the main thread,
`specheads.plumbing.interrupts`, so every `finally` here runs)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import torch

from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import path_kind
from specheads.plumbing.lock import folder_lock, lock_files

COMMAND = "export"
LOCK_NAMES = lock_files(COMMAND)
"""The files `export_lock` keeps in `--out` while an export runs (never copied, never counted as content)."""


@contextmanager
def export_lock(out: Path) -> Iterator[None]:
    """Hold `out`'s export lock for the block (`specheads.plumbing.lock.folder_lock`: a second export into `out` is
    refused at once, naming the holder). The lock's files live in `out` and leave with it: the finished folder replaces
    `out` whole, and a block that ends otherwise takes them away while still holding the lock."""
    with folder_lock(out, COMMAND):
        try:
            yield
        finally:
            for name in LOCK_NAMES:
                (out / name).unlink(missing_ok=True)


def check_empty(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that holds anything beyond an export's lock files, unless `overwrite`."""
    if not overwrite and out.is_dir() and any(path.name not in LOCK_NAMES for path in out.iterdir()):
        raise UsageError(f"{out} already holds files; choose another --out or pass --overwrite")


def check_tree(folder: Path, flag: str) -> None:
    """Refuse, in one line, a folder export copies that holds anything but regular files and folders (a symbolic
    link would copy what it points to, a device or FIFO would be read without end); `folder` itself may be a link."""
    for root, folders, names in os.walk(folder):
        for name in [*folders, *names]:
            path = Path(root) / name
            kind = path_kind(path)
            if kind not in ("file", "folder") and name not in LOCK_NAMES:
                raise UsageError(f"{flag} {folder} holds {path.relative_to(folder)} as a {kind}, which export would "
                                 "copy (a link copies what it points to); give a folder of regular files (copy it with "
                                 "`cp -rL`, or download it with `hf download --local-dir`)")


def regular_file(path: Path, flag: str) -> Path | None:
    """`path` when it is a regular file export may copy, None when nothing is there; refused when it is a link or a
    special file (`check_tree`'s reasons)."""
    kind = path_kind(path)
    if kind not in (None, "file"):
        raise UsageError(f"{flag}: {path} is a {kind}, not a regular file, and export would copy it; put the file "
                         "itself there, or remove it")
    return path if kind else None


def inside(folder: Path, name: object, where: str) -> Path:
    """`folder / name` for a file name read from `where`, refused unless it is a relative path that stays inside
    `folder` (no `..`, no absolute path, no link leading out) and names a regular file."""
    if not isinstance(name, str) or not name or "\\" in name or PurePosixPath(name).is_absolute() \
            or ".." in PurePosixPath(name).parts:
        raise UsageError(f"{where} names the file {name!r}, which is not a plain relative name inside "
                         f"{folder}; give an index whose files lie in the checkpoint's folder")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()) or path_kind(path) != "file":
        raise UsageError(f"{where} names {name!r}, which is not a regular file inside {folder} (missing, a link or a "
                         "special file); give an index whose files lie in the checkpoint's folder")
    return path


def check_not_holding(out: Path, inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """Refuse an `--out` that is, or holds, one of `inputs` ((flag, path); absent paths skipped): writing it would
    replace the input, and `--overwrite` would delete it."""
    target = out.expanduser().resolve()
    for flag, given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        source = Path(given).expanduser().resolve()
        if source == target or source.is_relative_to(target):
            what = "is" if source == target else "holds"
            raise UsageError(f"--out {out} {what} the input {flag} {given}, which writing --out would replace (and "
                             "--overwrite delete); choose an --out outside it")


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse, in one line, tensors with a NaN or an infinity as they would be written (after any dtype cast)."""
    bad = [name for name, tensor in tensors.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise UsageError(f"{what}: {', '.join(bad[:3])} would be written with NaN or infinite values (a zero "
                         "hidden_std, weights too large for the stored dtype, or a diverged run); retrain the head or "
                         "store it in a wider dtype")
