"""The `specheads` console command: dispatches to the subcommand's own package."""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import pickle
import shlex
import signal
import sys
import textwrap
from pathlib import Path

from specheads import __version__
from specheads.plumbing.config_files import with_configs_resolved
from specheads.plumbing.errors import UsageError
from specheads.plumbing.interrupts import Interrupted, raising, received, signals_raise
from specheads.plumbing.noise import third_party_quiet

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "gen": ("specheads.data_gen.cli", "label token mixes from a draft/target pair into an Arrow dataset"),
    "train": ("specheads.train.cli", "fit an acceptance head on a labelled dataset (Lightning CLI: `specheads train fit --help`)"),
    "eval": ("specheads.eval.cli", "ROC/AUC, binary KL, calibration and decoding runs of a head against training-free baselines"),
    "profile": ("specheads.eval.profile", "forward time against tokens, measured here or by a roofline preset: the cost "
                "table for `eval --serving-costs`"),
    "export": ("specheads.export.cli", "write a head folder (safetensors + config.json + model card) and push it to the Hub"),
    "demo": ("specheads.demo.cli", "the whole pipeline on the embedded pair: gen, train both heads, eval, export, one report"),
}

USAGE = "usage: specheads {" + ",".join(SUBCOMMANDS) + "} [options]   (specheads SUBCOMMAND --help)"


DEBUG_FLAG, DEBUG_ENV = "--debug", "SPECHEADS_DEBUG"
MESSAGE_WIDTH = 300  # an unexpected error's own text is shortened to this, at a word boundary


def failure_line(error: BaseException) -> str:
    """One line for a failure that is not a UsageError: what went wrong and what to do about it."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" writing {error.filename}" if error.filename else ""
        return (f"the disk is full{where} (No space left on device); free space or choose another --out, then run the "
                "same command again: finished work is kept")
    if isinstance(error, OSError) and error.errno in (errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        exists = ("exists and is not a folder" if error.filename and not Path(str(error.filename)).is_dir()
                  else "exists already")
        what = {errno.EROFS: "is on a read-only file system", errno.ENOTDIR: "has a file where a folder should be",
                errno.EEXIST: exists, errno.EISDIR: "is a folder where a file should be"}[error.errno]
        return (f"{error.filename or error} {what}; choose an output path you can write to, or fix that path, "
                "then run the same command again")
    if isinstance(error, PermissionError):
        return f"permission denied: {error.filename or error}; choose a folder you can write to, or fix its permissions"
    if isinstance(error, pickle.UnpicklingError):  # torch's message advises loading the file unsafely: never shown
        from specheads.artifacts.checkpoint import unpickling_reason

        return (f"refused to load a file that pickles Python objects beyond tensors ({unpickling_reason(error)}), which "
                "could run code when loaded; give a checkpoint that `specheads train` wrote")
    if isinstance(error, (MemoryError, torch_out_of_memory())):
        return ("out of memory; lower the batch size (--batch-size, --data.batch_size) or the sequence lengths, "
                "or use a device with more memory")
    message = textwrap.shorten(str(error), MESSAGE_WIDTH, placeholder=" …") or "no message"  # never cut mid-word or URL
    return (f"unexpected {type(error).__name__}: {message}; run again with {DEBUG_ENV}=1 (or {DEBUG_FLAG}) for the "
            "traceback, and report it if the input looks right")


def torch_out_of_memory() -> type[BaseException]:
    """torch's out-of-memory error type, where torch is already imported (a subclass of RuntimeError)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", MemoryError) if torch else MemoryError


def end_process_group() -> None:
    """Destroy this rank's process group, where a run set one up. Lightning does so at exit for NCCL only; a gloo
    group left to the interpreter's exit aborts its process now and then ("terminate called without an active
    exception", SIGABRT) when another rank ends first, and torchrun then fails the finished run."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def resume_command(argv: list[str]) -> str:
    """The command that resumes an interrupted `specheads ARGV`: the same one, or what the subcommand's own
    `resume_argv` makes of it (`specheads train fit` adds `--ckpt_path last`)."""
    module = sys.modules.get(SUBCOMMANDS[argv[0]][0])
    resumed = argv[:1] + module.resume_argv(argv[1:]) if hasattr(module, "resume_argv") else argv
    return shlex.join(["specheads", *resumed])


def interrupted_line(argv: list[str], signal_name: str) -> str:
    """The one line an interrupted run ends with: the signal, what is kept, the command that resumes it."""
    return (f"specheads {argv[0]}: stopped by {signal_name} before the run finished; finished work is kept; resume "
            f"with: {resume_command(argv)}")


def stopped(argv: list[str], signum: int, nested: bool = False, cause: BaseException | None = None) -> int:
    """Report a run stopped by `signum`: its line and exit code (128 + signum), or `Interrupted` for the command
    that runs this one (`nested`) to report."""
    if nested:
        raise Interrupted(signum) from cause
    print(interrupted_line(argv, signal.Signals(signum).name), file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    """Run `specheads SUBCOMMAND ...`; returns the process exit code.

    A failure prints one line and exits non-zero: 2 for bad input (UsageError), 1 for anything else, 130 on SIGINT
    (Ctrl-C) and 143 on SIGTERM, with the command that resumes the run (`specheads.plumbing.interrupts`). `--debug`
    (anywhere) or SPECHEADS_DEBUG=1 lets the traceback through instead, and with it the third-party output (framework
    tips, warnings, loading bars) that is otherwise kept quiet."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        for name, (_, what) in SUBCOMMANDS.items():
            print(f"  {name:8s} {what}")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    name, nested = argv[0], raising()  # nested: run by another command (the demo's stages), which reports a stop
    if name not in SUBCOMMANDS:
        print(f"specheads: error: unknown subcommand {name!r}; known: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    try:
        with signals_raise(), contextlib.nullcontext() if debug else third_party_quiet():
            module = importlib.import_module(SUBCOMMANDS[name][0])
            return int(module.main(with_configs_resolved(argv[1:], name)) or 0)
    except UsageError as error:
        if debug:
            raise
        print(f"specheads {name}: error: {error}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as stop:
        if debug or nested:
            raise
        return stopped(argv, stop.signum if isinstance(stop, Interrupted) else signal.SIGINT)
    except SystemExit:  # Lightning's own exit on a SIGTERM it saw too (`SIGTERMException`: code None, success)
        if received() is None or debug:
            raise
        return stopped(argv, received(), nested)
    except Exception as error:  # the last resort: one line instead of a traceback
        stopped_by = received()
        if stopped_by is not None and not debug:  # a stop that a library's C code turned into an error of its own
            return stopped(argv, stopped_by, nested, error)
        if debug:
            raise
        print(f"specheads {name}: error: {failure_line(error)}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):  # a finished run is not failed by its teardown
            end_process_group()


if __name__ == "__main__":
    sys.exit(main())
