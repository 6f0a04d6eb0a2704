"""`specheads train {fit,validate}`: Lightning's own CLI over `AcceptanceModule` and `AcceptanceDataModule`.

    specheads train fit --config configs/train/specdecpp.yaml --data.path runs/gen/smollm2-demo

Every YAML field can be overridden (`--model.lr 3e-4`, `--trainer.devices 2`), `--print_config`
prints the resolved config, and `--ckpt_path last` resumes. The run folder is
`trainer.default_root_dir`: `checkpoints/` (last.ckpt and the best by validation binary KL),
`config.yaml`, `split.json`, `metrics.csv` and `tensorboard/`.
"""

from __future__ import annotations

import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from specheads.data import AcceptanceDataModule
from specheads.private_apis import HistoryWriter
from specheads.train.module import AcceptanceModule

TRAINER_DEFAULTS = {
    "max_epochs": 3,
    "use_distributed_sampler": False,  # AcceptanceDataModule gives each rank its own slice of every batch
    "log_every_n_steps": 5,
    "default_root_dir": "runs/train",
}


class HistoryCSVLogger(CSVLogger):
    """A CSV logger whose run continues the metrics history of the run it resumes instead of deleting it."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self._root_dir, exist_ok=True)
            self._experiment = HistoryWriter(log_dir=self.log_dir)
        return self._experiment


class TrainCLI(LightningCLI):
    """LightningCLI with the checkpoint policy and loggers of a specheads run folder."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.monitor": "val/binary_kl", "checkpoint.mode": "min",
                             "checkpoint.filename": "best-{epoch}-{step}", "checkpoint.auto_insert_metric_name": False})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = Path(config.trainer.default_root_dir)
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = str(root / "checkpoints")

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        config = self.config[self.subcommand] if self.subcommand else self.config
        # Lightning 2.6 writes `save_last` only when the monitored metric improved: keep the newest state ourselves
        trainer.callbacks.append(ModelCheckpoint(dirpath=config.checkpoint.dirpath, filename="last", monitor=None,
                                                 save_top_k=1, enable_version_counter=False))
        if config.trainer.logger in (None, True):
            root = config.trainer.default_root_dir
            resumed = config.get("ckpt_path") is not None
            csv_logger = (HistoryCSVLogger if resumed else CSVLogger)(root, name="", version="")
            trainer.loggers = [csv_logger, TensorBoardLogger(root, name="tensorboard", version="")]
        return trainer


PARSER_KWARGS = {"prog": "specheads train", "description": "Fit an acceptance head on a labelled dataset (`specheads train fit "
                 "--help` lists the options)."}


def build_cli(argv: list[str], callbacks: Sequence[Callback] = ()) -> TrainCLI:
    """Parse `argv` as `specheads train` does and run its subcommand; `callbacks` are added to the trainer's."""
    defaults = {**TRAINER_DEFAULTS, "callbacks": list(callbacks)} if callbacks else TRAINER_DEFAULTS
    with warnings.catch_warnings():
        # Lightning warns whenever the process has argv beside `args`: `specheads train` hands it its own on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return TrainCLI(AcceptanceModule, AcceptanceDataModule, args=argv, trainer_defaults=defaults, parser_kwargs=PARSER_KWARGS,
                        save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)


SIGTERM_EXIT = 128 + signal.SIGTERM


def main(argv: list[str]) -> int:
    """Entry point for `specheads train`. A run stopped by SIGTERM (a scheduler's preemption) exits 143, never 0."""
    try:
        build_cli(argv)
    except SIGTERMException:  # Lightning stops the loop this way; as a bare SystemExit it would read as success
        print("specheads train: error: stopped by SIGTERM before the run finished; resume it with the same command "
              "and --ckpt_path last", file=sys.stderr)
        return SIGTERM_EXIT
    except SystemExit as done:  # --help, --print_config and argument errors end the parser this way
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0
