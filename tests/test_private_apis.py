"""specheads.plumbing.private_apis leans on one private name each of Lightning and transformers: fail loudly when one moves."""

import csv
import inspect

import transformers.generation.utils as generation_utils
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from transformers import CompileConfig

from specheads.plumbing.private_apis import HistoryWriter, compile_on_every_device


def test_lightning_still_checks_the_log_folder_in_the_private_hook_history_writer_overrides():
    assert "_check_log_dir_exists" in inspect.getsource(_ExperimentWriter.__init__), (
        "Lightning's CSV ExperimentWriter no longer calls _check_log_dir_exists: specheads.plumbing.private_apis.HistoryWriter "
        "must find the new place where it deletes an existing metrics.csv")


def test_a_resumed_run_appends_to_its_metrics_history(tmp_path):
    first = HistoryWriter(str(tmp_path))
    first.log_metrics({"loss": 1.0}, step=0)
    first.save()
    again = HistoryWriter(str(tmp_path))  # Lightning's own writer would delete the file here
    again.log_metrics({"loss": 0.5}, step=1)
    again.save()
    with open(tmp_path / "metrics.csv", newline="") as file:
        assert [row["loss"] for row in csv.DictReader(file)] == ["1.0", "0.5"]


def test_transformers_still_reads_the_compile_switch_for_other_devices():
    assert hasattr(CompileConfig(), "_compile_all_devices"), "transformers' CompileConfig lost _compile_all_devices"
    assert "_compile_all_devices" in inspect.getsource(generation_utils), (
        "transformers' generate no longer reads CompileConfig._compile_all_devices: "
        "specheads.plumbing.private_apis.compile_on_every_device must find its new switch")
    assert compile_on_every_device(CompileConfig(), True)._compile_all_devices is True
