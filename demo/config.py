"""The `specheads demo` options and where its stage configs live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specheads.plumbing.config_files import packaged_configs
from specheads.plumbing.errors import UsageError

CONFIGS = packaged_configs()


@dataclass
class DemoConfig:
    """What `specheads demo` runs.

    Args:
        out: the demo folder (data/, train/, eval/, heads/, report.html, summary.json);
            default runs/demo, or runs/demo-quick with --quick.
        quick: the small version (about 1 k labelled tokens, a few decoding runs): every stage in a few minutes.
        overwrite: delete `out` first; without it a finished stage is reused and an unfinished one resumes.
        progress: show progress bars.
    """

    out: str | None = None
    quick: bool = False
    overwrite: bool = False
    progress: bool = True

    @property
    def folder(self) -> Path:
        """The demo folder."""
        return Path(self.out or ("runs/demo-quick" if self.quick else "runs/demo"))

    @property
    def size(self) -> str:
        """`quick` or `full`: the folder of stage configs under configs/demo/."""
        return "quick" if self.quick else "full"


def stage_config(size: str, name: str) -> Path:
    """A demo stage's override YAML, `configs/demo/<size>/<name>.yaml`."""
    return base_config(f"demo/{size}/{name}.yaml")


def base_config(relative: str) -> Path:
    """A YAML among the configs installed with specheads; a missing one means a broken install."""
    path = CONFIGS / relative
    if not path.is_file():
        raise UsageError(f"the config {path} is missing from the installed specheads; reinstall it "
                         "(`sh scripts/install.sh`, or `pip install .`)")
    return path
