"""The demo's stages as the `specheads` command lines a user would type, and the folders they fill."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specheads.demo.config import base_config, stage_config
from specheads.plumbing.files import write_json_atomic

HEADS = {"ontime": "on-time stop head", "expected": "expected-acceptance head", "sprinter": "SPRINTER verifier"}
"""The heads the demo trains and exports, by their folder names."""
TRAIN_CONFIGS = {"ontime": "train/specdecpp-ontime.yaml", "expected": "train/expected-acceptance.yaml",
                 "sprinter": "train/sprinter.yaml"}
EVALUATED = ("ontime", "sprinter")
"""The heads evaluated on their own: the expected-acceptance head plans the verify budget in the on-time head's eval."""
SHIPPED = "shipped"
SHIPPED_HEAD = "smollm2-ontime"
"""The head that ships with specheads (`load_head` finds it by this name), decoded beside the one the demo trains."""
TITLES = {**HEADS, SHIPPED: f"on-time head shipped with specheads ({SHIPPED_HEAD}, trained on 64x the data's samples)"}


@dataclass(frozen=True)
class Layout:
    """Where each stage writes inside the demo folder."""

    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    def run(self, head: str) -> Path:
        """The training run folder of `head`."""
        return self.root / "train" / head

    def checkpoint(self, head: str) -> Path:
        """The checkpoint eval and export read (the run's newest)."""
        return self.run(head) / "checkpoints" / "last.ckpt"

    def evaluated_head(self, head: str) -> str:
        """What eval reads for `head`: its checkpoint, or the shipped head's name."""
        return SHIPPED_HEAD if head == SHIPPED else str(self.checkpoint(head))

    def report(self, head: str) -> Path:
        """The eval report folder of `head`."""
        return self.root / "eval" / head

    def exported(self, head: str) -> Path:
        """The exported head folder."""
        return self.root / "heads" / head


def kept_or_measured(path: Path, identity: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The wall-clock line kept in `path` where it was measured with this `identity` (its settings, the files it read),
    else `measure()`'s, written there with the identity; returned either way."""
    if path.is_file():
        kept = json.loads(path.read_text())
        if {key: kept.get(key) for key in identity} == identity:
            return kept
    result = {**identity, **measure()}
    write_json_atomic(path, result)
    return result


@dataclass(frozen=True)
class Stage:
    """One step of the demo: a title and the `specheads` arguments that do it."""

    key: str
    title: str
    argv: tuple[str, ...]

    def command(self) -> str:
        """The equivalent shell command, paths relative to the working directory where possible."""
        return "specheads " + shlex.join(relative(arg) for arg in self.argv)


def relative(arg: str) -> str:
    """`arg` relative to the working directory when it is a path below it."""
    if not arg.startswith("/"):
        return arg
    try:
        return os.path.relpath(arg) if Path(arg).resolve().is_relative_to(Path.cwd().resolve()) else arg
    except ValueError:
        return arg


def gen_stage(layout: Layout, size: str, progress: bool) -> Stage:
    """Label the built-in prompts with the embedded pair (both heads' rows in one dataset)."""
    argv = ("gen", "--config", str(base_config("gen/smollm2-demo.yaml")), "--config", str(stage_config(size, "gen")),
            "--out", str(layout.data), "--progress", str(progress).lower())
    return Stage("gen", "label token mixes with the embedded pair", argv)


def train_stage(layout: Layout, size: str, head: str, progress: bool) -> Stage:
    """Fit `head` (a key of HEADS) with Lightning; resumes a run folder that holds a checkpoint."""
    argv = ["train", "fit", "--config", str(base_config(TRAIN_CONFIGS[head])), "--config", str(stage_config(size, head)),
            "--data.path", str(layout.data), "--trainer.default_root_dir", str(layout.run(head)),
            "--trainer.enable_progress_bar", str(progress).lower()]
    if layout.checkpoint(head).is_file():
        argv += ["--ckpt_path", "last"]
    return Stage(f"train_{head}", f"train the {HEADS[head]}", tuple(argv))


def eval_stage(layout: Layout, size: str, head: str, progress: bool) -> Stage:
    """Offline metrics and decoding runs of `head` (one of EVALUATED) on prompts it never trained on: the on-time
    head's with the verify budget's serving line (planned by the expected-acceptance head), the verifier's taking the
    on-time head's constant-K runs."""
    argv = ["eval", "--config", str(stage_config(size, f"eval-{head}")), "--head", str(layout.checkpoint(head)),
            "--data", str(layout.data), "--out", str(layout.report(head)), "--progress", str(progress).lower()]
    if head == "ontime":
        argv += ["--budget-head", str(layout.checkpoint("expected"))]
    else:
        argv += ["--reuse-runs", str(layout.report("ontime"))]
    return Stage(f"eval_{head}", f"evaluate the {HEADS[head]}", tuple(argv))


def shipped_eval_stage(layout: Layout, size: str, progress: bool) -> Stage:
    """The shipped on-time head on the demo's data and decode prompts, as the on-time head's eval takes them, less
    every prompt it trained or calibrated on (its config.json lists them): its held-out rows and decoding runs, without
    the serving table."""
    argv = ("eval", "--config", str(stage_config(size, "eval-ontime")), "--head", SHIPPED_HEAD, "--data",
            str(layout.data), "--out", str(layout.report(SHIPPED)), "--allow-other-data", "true",
            "--serving-batch-sizes", "null", "--serving-costs", "null", "--progress", str(progress).lower())
    return Stage(f"eval_{SHIPPED}", f"evaluate the {TITLES[SHIPPED]}", argv)


def export_stage(layout: Layout, head: str) -> Stage:
    """Write the head folder with its decision rule (from its eval report, where it has one) and model card."""
    argv = ["export", "--ckpt", str(layout.checkpoint(head)), "--out", str(layout.exported(head)), "--overwrite"]
    if head in EVALUATED:
        argv += ["--report", str(layout.report(head))]
    return Stage(f"export_{head}", f"export the {HEADS[head]}", tuple(argv))
