"""The Lightning callback that makes a stop signal (SIGINT, SIGTERM) take effect at the end of a batch, where no
library holds a lock (`specheads.plumbing.interrupts`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from specheads.plumbing.interrupts import defer_stops, raise_pending


class StopAtBatchEnds(Callback):
    """From the Trainer's setup to its teardown (or its failure), a stop is recorded, then raised as `Interrupted` at
    the end of the next training, validation, test or prediction batch."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        defer_stops(True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        defer_stops(False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        defer_stops(False)

    def on_train_batch_end(self, *args: Any) -> None:
        raise_pending()

    def on_validation_batch_end(self, *args: Any) -> None:
        raise_pending()

    def on_test_batch_end(self, *args: Any) -> None:
        raise_pending()

    def on_predict_batch_end(self, *args: Any) -> None:
        raise_pending()
