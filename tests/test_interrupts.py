"""Ctrl-C (SIGINT) and a scheduler's stop (SIGTERM) end `train drafter`, `gen` and `train fit` alike (issue 70): exit
130 or 143, one line on stderr saying the run was stopped and the exact command that resumes it, and nothing reported
as done. Each command runs in its own process on the tiny fixtures; the signal comes once its work has begun."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import tiny_args
from test_eagle3 import recipe_args

from specheads.cli import main

SERVER = """
import atexit, importlib, json, os, runpy, sys
for name in ("torch", "transformers", "lightning.pytorch", "transformers.models.llama.modeling_llama",
             "specheads.cli", "specheads.data_gen.cli", "specheads.data_gen.run", "specheads.train.cli",
             "specheads.train.module", "specheads.train.drafter", "speculators.models.eagle3"):
    try:  # what the commands load, loaded once: each fork starts where `python -m specheads` has imported it
        importlib.import_module(name)
    except ImportError:
        pass
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: `python -m specheads ARGS`, its stdout to /dev/null, its stderr to a file
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = ["specheads", *request["args"]]
        try:
            runpy.run_module("specheads", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        atexit._run_exitfuncs()  # what the interpreter's exit runs, less its teardown of every module (seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with open(request["code"] + ".part", "w") as out:
        out.write(str(code))
    os.replace(request["code"] + ".part", request["code"])
"""


@pytest.fixture(scope="module")
def commands():
    """One interpreter that imports what the commands import, once, then forks a fresh `python -m specheads` process
    per command: each is its own process, stopped by a real signal, at the cost of its work and not of its imports."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert server.stdout.readline().strip() == "ready"
    yield server
    server.kill()  # its own exit would tear down every module it imported: seconds for nothing
    server.wait(timeout=60)


def stopped(commands, args: list[str], ready: Callable[[], bool], signum: int, folder: Path,
            timeout: float = 300) -> tuple[int, str]:
    """Start `specheads ARGS` (a fork of `commands`), send it `signum` once `ready()` holds, and return (its exit code,
    its stderr)."""
    err, code = folder / "stderr.txt", folder / "exit-code"
    commands.stdin.write(json.dumps({"args": args, "stderr": str(err), "code": str(code)}) + "\n")
    commands.stdin.flush()
    pid = int(commands.stdout.readline())
    deadline = time.time() + timeout
    while time.time() < deadline and not code.exists() and not ready():
        time.sleep(0.05)
    assert not code.exists(), f"the command must still be working when the signal comes: {err.read_text()}"
    os.kill(pid, signum)
    while time.time() < deadline + timeout and not code.exists():
        time.sleep(0.05)
    return int(code.read_text()), err.read_text()


def assert_interrupted(code: int, err: str, signum: int, resume: list[str]) -> None:
    """Exit 128 + signum, and one line naming the signal and the command that resumes the run."""
    name = signal.Signals(signum).name
    assert code == 128 + signum, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert f"stopped by {name}" in lines[0] and lines[0].endswith("resume with: " + shlex.join(["specheads", *resume]))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_drafter_training_exits_with_the_signal_and_the_resume_command(commands, tiny_model, prompts_file,
                                                                                      tmp_path, signum):
    pytest.importorskip("speculators.models.eagle3")
    out = tmp_path / "run"
    args = recipe_args(tiny_model, prompts_file, out, "--max-steps", "100000", "--checkpoint-every", "1")
    code, err = stopped(commands, args, lambda: (out / "train" / "checkpoints" / "last.ckpt").is_file(), signum,
                        tmp_path)
    assert_interrupted(code, err, signum, args)
    assert not (out / "drafter").exists() and not (out / "fingerprint.json").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_gen_exits_with_the_signal_and_the_resume_command(commands, tiny_model, prompts_file, tmp_path,
                                                                          signum):
    # Lightning's predict loop never looks at the SIGTERM it records: gen labelled on to exit 0
    out = tmp_path / "gen"
    args = tiny_args(tiny_model, prompts_file, out, "--samples-per-prompt", "4", "--max-new-tokens", "24")
    code, err = stopped(commands, args, lambda: (out / "manifest.json").is_file(), signum, tmp_path)
    assert_interrupted(code, err, signum, args)
    assert json.loads((out / "manifest.json").read_text())["complete"] is False


@pytest.fixture(scope="module")
def labelled(tiny_model, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interrupts") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, out)) == 0
    return out


def test_ctrl_c_in_train_fit_exits_130_with_the_command_that_resumes_from_the_last_checkpoint(commands, labelled,
                                                                                             tmp_path):
    configs = Path(__file__).parents[1] / "configs" / "train"
    root = tmp_path / "fit"
    args = ["train", "fit", "--config", str(configs / "specdecpp.yaml"), "--data.path", str(labelled),
            "--data.val_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "100000"]
    code, err = stopped(commands, args, lambda: (root / "checkpoints" / "last.ckpt").is_file(), signal.SIGINT,
                        tmp_path)
    assert_interrupted(code, err, signal.SIGINT, [*args, "--ckpt_path", "last"])


def test_a_stop_that_a_library_turned_into_its_own_error_still_exits_by_the_signal(monkeypatch, capsys):
    # pyarrow, reading a dataset's schema when Ctrl-C came, caught the handler's exception and raised ArrowInvalid
    import specheads.eval.profile as profile

    def stopped_inside_c_code(argv: list[str]) -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        except BaseException as caught:
            raise RuntimeError("Schema at index 0 was different") from caught
        return 0

    monkeypatch.setattr(profile, "main", stopped_inside_c_code)
    assert main(["profile", "--out", "costs.json"]) == 130
    err = capsys.readouterr().err
    assert "SIGINT" in err and "unexpected" not in err
    monkeypatch.setattr(profile, "main", lambda argv: 1 / 0)  # a later failure in the same process is a failure
    assert main(["profile", "--out", "costs.json"]) == 1
    assert "unexpected ZeroDivisionError" in capsys.readouterr().err


def test_a_command_another_runs_in_process_leaves_the_stop_to_it(monkeypatch, capsys):
    # the demo runs its stages through `main`: a stop must end the demo (its own line, its exit), not one stage
    import specheads.eval.profile as profile
    from specheads.plumbing.interrupts import Interrupted, signals_raise

    def interrupted_at_once(argv: list[str]) -> int:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the signal's exception ends this at once
        return 0

    monkeypatch.setattr(profile, "main", interrupted_at_once)
    with pytest.raises(Interrupted), signals_raise():
        main(["profile", "--out", "costs.json"])
    assert capsys.readouterr().err == ""
    assert main(["profile", "--out", "costs.json"]) == 130
    assert capsys.readouterr().err.strip().endswith("resume with: specheads profile --out costs.json")


def test_a_stop_during_a_trainer_run_waits_for_the_batch_end_and_the_loggers_close(labelled, tmp_path, monkeypatch,
                                                                                     capsys):
    # raised inside the TensorBoard writer's queue, the stop once left its thread waiting forever: the exit hung
    import threading

    from lightning.pytorch.loggers import TensorBoardLogger

    logged_through, log_metrics = [], TensorBoardLogger.log_metrics

    def stopped_while_logging(self, *args, **kwargs):
        if not logged_through:
            os.kill(os.getpid(), signal.SIGTERM)
        log_metrics(self, *args, **kwargs)
        logged_through.append(True)

    monkeypatch.setattr(TensorBoardLogger, "log_metrics", stopped_while_logging)
    configs = Path(__file__).parents[1] / "configs" / "train"
    args = ["train", "fit", "--config", str(configs / "specdecpp.yaml"), "--data.path", str(labelled),
            "--data.val_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir", str(tmp_path / "fit"),
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "100000",
            "--trainer.log_every_n_steps", "1"]
    assert main(args) == 128 + signal.SIGTERM
    assert_interrupted(128 + signal.SIGTERM, capsys.readouterr().err, signal.SIGTERM, [*args, "--ckpt_path", "last"])
    assert logged_through, "the stop must wait for the end of the batch, not break into the logger's write"
    writers = [thread for thread in threading.enumerate() if type(thread).__name__ == "_AsyncWriterThread"]
    assert not writers, "the TensorBoard writer's thread must have been joined"


def test_lightnings_own_sigterm_exit_is_reported_as_the_stop(monkeypatch, capsys):
    # Lightning raises SIGTERMException, a SystemExit with no code (success), after a SIGTERM it recorded too
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    import specheads.eval.profile as profile
    from specheads.plumbing.interrupts import defer_stops

    def stopped_by_lightning(argv: list[str]) -> int:
        defer_stops(True)  # inside a Trainer: the handler records the stop
        os.kill(os.getpid(), signal.SIGTERM)
        raise SIGTERMException

    monkeypatch.setattr(profile, "main", stopped_by_lightning)
    assert main(["profile", "--out", "costs.json"]) == 128 + signal.SIGTERM
    assert_interrupted(128 + signal.SIGTERM, capsys.readouterr().err, signal.SIGTERM, ["profile", "--out", "costs.json"])
