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
        out: the demo folder (data/, train/, eval/, heads/, lookup/, report.html, speedup.png, summary.json);
            default runs/demo, or runs/demo-quick with --quick.
        quick: the small version (about 1 k labelled tokens, a few decoding runs): every stage in a few minutes.
        overwrite: delete `out` first; without it a finished stage is reused and an unfinished one resumes.
        progress: show progress bars.
        eagle3: an EAGLE-3 drafter folder for the embedded target (`specheads train drafter --config
            eagle3-smollm2`): the demo adds its wall-clock line at B = 1 (target alone, constant K = 1, transformers'
            default rule, and with `eagle3_head` the head's stop rule) beside the modelled one.
        eagle3_head: a stop head trained on data that drafter labelled (`specheads gen --config smollm2-eagle3`).
        eagle3_cost_ratio: the c = t_draft/t_target that head's rule read from the costs is decoded at (the drafter's,
            profiled: `specheads profile --eagle3 DIR`).
        lookup_head: the token-only head folder (`specheads.heads.lookup.TokenHeadModel.export`) whose rule the
            prompt-lookup line decodes; default the one shipped with specheads (smollm2-lookup), where it ships.
    """

    out: str | None = None
    quick: bool = False
    overwrite: bool = False
    progress: bool = True
    eagle3: str | None = None
    eagle3_head: str | None = None
    eagle3_cost_ratio: float = 0.086
    lookup_head: str | None = None

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
