"""The two private names of Lightning and transformers that specheads relies on, in one place.

Neither library has a public switch for these; `tests/test_private_apis.py` fails loudly, naming the library, the
day either name moves, instead of the behaviour changing without a word.

- Lightning's CSV `ExperimentWriter` deletes an existing metrics.csv in `_check_log_dir_exists`, called from its
  constructor; a resumed run should append to the history instead (`HistoryWriter` overrides that one check).
- transformers compiles `generate`'s decoding step on accelerators only; `CompileConfig._compile_all_devices` is its
  own switch for other devices, read in `GenerationMixin._valid_auto_compile_criteria` (`compile_on_every_device`).
"""

from __future__ import annotations

import csv

from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from transformers import CompileConfig


class HistoryWriter(ExperimentWriter):
    """Lightning's CSV writer, except that it keeps the metrics.csv it finds and appends to it (a resumed run)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = sorted(next(csv.reader(file), []))


def compile_on_every_device(config: CompileConfig, every_device: bool) -> CompileConfig:
    """`config` told to compile on the CPU (and any other device) too, when `every_device`."""
    config._compile_all_devices = every_device
    return config
