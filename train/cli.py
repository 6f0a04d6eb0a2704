"""`specheads train {fit,validate}`: Lightning's own CLI over `AcceptanceModule` and `AcceptanceDataModule`.

    specheads train fit --config configs/train/specdecpp.yaml --data.path runs/gen/smollm2-demo

Every YAML field can be overridden (`--model.lr 3e-4`, `--trainer.devices 2`), `--print_config`
prints the resolved config, and `--ckpt_path last` resumes. The run folder is
`trainer.default_root_dir`: `checkpoints/` (last.ckpt and the best by validation binary KL),
`config.yaml`, `split.json`, `metrics.csv` and `tensorboard/`.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from specheads.artifacts.checkpoint import read_checkpoint
from specheads.dataset.datamodule import AcceptanceDataModule
from specheads.plumbing.batch_end_stops import StopAtBatchEnds
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder
from specheads.plumbing.private_apis import HistoryWriter
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


class RunFolder:
    """What a run folder held before the run, so that a refused run can take away what it made there (Lightning
    writes `config.yaml`, `tensorboard/` and the CSV log before the module's checks refuse the data)."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.before: set[Path] | None = None  # None: the run made the folder
        self.checkpoints: Path | None = None
        self.checkpoints_before: set[Path] = set()

    def note(self, root: Path, checkpoints: Path) -> None:
        """Remember what `root` and the checkpoint folder hold now, before the run writes anything."""
        self.root, self.checkpoints = root, checkpoints
        self.before = set(root.iterdir()) if root.is_dir() else None
        self.checkpoints_before = set(checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else set()

    def undo(self) -> None:
        """Remove what the run made in its folder (the folder too, when it made it), unless it saved a checkpoint:
        then it trained, and what it wrote is kept."""
        if self.root is None or not self.root.is_dir():
            return
        if self.checkpoints is not None and set(self.checkpoints.glob("*.ckpt")) - self.checkpoints_before:
            return
        made = [self.root] if self.before is None else sorted(set(self.root.iterdir()) - self.before)
        for path in made:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def checkpoint_folder(config: Any) -> Path:
    """Where a run's checkpoints go: `--checkpoint.dirpath`, else `checkpoints/` in `--trainer.default_root_dir`."""
    return Path(config.checkpoint.dirpath or Path(config.trainer.default_root_dir) / "checkpoints")


class TrainCLI(LightningCLI):
    """LightningCLI with the checkpoint policy and loggers of a specheads run folder."""

    def __init__(self, *args: Any, run_folder: RunFolder | None = None, **kwargs: Any) -> None:
        self.run_folder = run_folder if run_folder is not None else RunFolder()
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.monitor": "val/binary_kl", "checkpoint.mode": "min",
                             "checkpoint.filename": "best-{epoch}-{step}", "checkpoint.auto_insert_metric_name": False})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then refuse a `--ckpt_path` file that pickles more than tensors in one line (`read_checkpoint`)
        before Lightning reads its hyperparameters (its refusal quotes torch's advice to load it unsafely)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        resume = self.config[subcommand].get("ckpt_path") if subcommand else None
        if resume == "last":  # the newest checkpoint of this run's folder, as Lightning resolves it
            resume = str(checkpoint_folder(self.config[subcommand]) / "last.ckpt")
        if resume and Path(resume).is_file():
            read_checkpoint(Path(resume))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = Path(config.trainer.default_root_dir)
        check_output_folder(root, "--trainer.default_root_dir")
        config.checkpoint.dirpath = str(checkpoint_folder(config))
        check_output_folder(Path(config.checkpoint.dirpath), "--checkpoint.dirpath")
        self.run_folder.note(root, Path(config.checkpoint.dirpath))

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        config = self.config[self.subcommand] if self.subcommand else self.config
        # Lightning 2.6 writes `save_last` only when the monitored metric improved: keep the newest state ourselves
        trainer.callbacks.append(ModelCheckpoint(dirpath=config.checkpoint.dirpath, filename="last", monitor=None,
                                                 save_top_k=1, enable_version_counter=False))
        trainer.callbacks.append(StopAtBatchEnds())
        if config.trainer.logger in (None, True):
            root = config.trainer.default_root_dir
            resumed = config.get("ckpt_path") is not None
            csv_logger = (HistoryCSVLogger if resumed else CSVLogger)(root, name="", version="")
            trainer.loggers = [csv_logger, TensorBoardLogger(root, name="tensorboard", version="")]
        return trainer


PARSER_KWARGS = {"prog": "specheads train", "description": "Fit an acceptance head on a labelled dataset (`specheads train fit "
                 "--help` lists the options)."}


def build_cli(argv: list[str], callbacks: Sequence[Callback] = (), run_folder: RunFolder | None = None,
              classes: tuple[type, type] = (AcceptanceModule, AcceptanceDataModule)) -> TrainCLI:
    """Parse `argv` as `specheads train` does and run its subcommand; `callbacks` are added to the trainer's, and
    `run_folder` notes what the run folder held before the run; `classes` are the module and data module (a free
    draft's token head: `train.lookup`)."""
    defaults = {**TRAINER_DEFAULTS, "callbacks": list(callbacks)} if callbacks else TRAINER_DEFAULTS
    with warnings.catch_warnings():
        # Lightning warns whenever the process has argv beside `args`: `specheads train` hands it its own on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return TrainCLI(*classes, args=argv, trainer_defaults=defaults, parser_kwargs=PARSER_KWARGS,
                        save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False,
                        run_folder=run_folder)


def resume_argv(argv: list[str]) -> list[str]:
    """The arguments that resume an interrupted `specheads train ARGV` (`specheads.cli.resume_command`): a fit from its
    folder's newest checkpoint (`--ckpt_path last` in place of any other), anything else as it was given."""
    if "fit" not in argv[:2]:
        return argv
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--ckpt_path="):
            skip = False
            continue
        if arg == "--ckpt_path":
            skip = True
            continue
        kept.append(arg)
    return [*kept, "--ckpt_path", "last"]


def main(argv: list[str]) -> int:
    """Entry point for `specheads train`. A run stopped by SIGTERM (a scheduler's preemption) exits 143, never 0; a
    refused run leaves nothing it made in the run folder. `specheads train drafter` trains an EAGLE-3 or DSpark drafter instead
    (`specheads.train.drafter`); `specheads train lookup fit` a free draft's token head (`specheads.train.lookup`)."""
    if argv[:1] == ["drafter"]:
        from specheads.train.drafter import main as drafter_main

        return drafter_main(argv[1:])
    classes: tuple[type, type] = (AcceptanceModule, AcceptanceDataModule)
    if argv[:2] == ["lookup", "from-logs"]:  # a free draft's token head from what a server recorded
        from specheads.train.lookup import LookupHeadModule
        from specheads.train.lookup_logs import LogDataModule

        argv, classes = argv[2:], (LookupHeadModule, LogDataModule)
    elif argv[:1] == ["lookup"]:  # a free draft's token head on lookup labels
        from specheads.train.lookup import LookupDataModule, LookupHeadModule

        argv, classes = argv[1:], (LookupHeadModule, LookupDataModule)
    run_folder = RunFolder()
    try:
        build_cli(argv, run_folder=run_folder, classes=classes)
    except (UsageError, pickle.UnpicklingError):  # refused: the input, or a checkpoint that pickles code
        run_folder.undo()
        raise
    except SIGTERMException:  # Lightning's stop, a SystemExit: not the parser's exit below; specheads.cli reports it
        raise
    except SystemExit as done:  # --help, --print_config and argument errors end the parser this way
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0
