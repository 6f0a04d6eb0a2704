"""`specheads train {fit,validate}`: Lightning's own CLI over `AcceptanceModule` and `AcceptanceDataModule`.

    specheads train fit --config configs/train/specdecpp.yaml --data.path runs/gen/smollm2-demo

Every YAML field can be overridden (`--model.lr 3e-4`, `--trainer.devices 2`), `--print_config`
prints the resolved config, and `--ckpt_path last` resumes. The run folder is
`trainer.default_root_dir`: `checkpoints/` (last.ckpt and the best by validation binary KL),
`config.yaml`, `split.json`, `metrics.csv` and `tensorboard/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from train.data import AcceptanceDataModule
from train.module import AcceptanceModule

TRAINER_DEFAULTS = {
    "max_epochs": 3,
    "use_distributed_sampler": False,  # AcceptanceDataModule gives each rank its own slice of every batch
    "log_every_n_steps": 5,
    "default_root_dir": "runs/train",
}


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
            trainer.loggers = [CSVLogger(root, name="", version=""), TensorBoardLogger(root, name="tensorboard", version="")]
        return trainer


def build_cli(argv: list[str], callbacks: Sequence[Callback] = ()) -> TrainCLI:
    """Parse `argv` as `specheads train` does and run its subcommand; `callbacks` are added to the trainer's."""
    defaults = {**TRAINER_DEFAULTS, "callbacks": list(callbacks)} if callbacks else TRAINER_DEFAULTS
    return TrainCLI(AcceptanceModule, AcceptanceDataModule, args=argv, trainer_defaults=defaults,
                    save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False)


def main(argv: list[str]) -> int:
    """Entry point for `specheads train`."""
    try:
        build_cli(argv)
    except SystemExit as done:  # --help, --print_config and argument errors end the parser this way
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0
