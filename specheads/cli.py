"""The `specheads` console command: dispatches to the subcommand's own package."""

from __future__ import annotations

import importlib
import sys

from specheads import __version__
from specheads.errors import UsageError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "gen": ("data_gen.cli", "label token mixes from a draft/target pair into an Arrow dataset"),
    "train": ("train.cli", "fit an acceptance head on a labelled dataset (Lightning CLI: `specheads train fit --help`)"),
    "eval": ("eval.cli", "ROC/AUC, binary KL, calibration and decoding runs of a head against training-free baselines"),
    "export": ("export.cli", "write a head folder (safetensors + config.json + model card) and push it to the Hub"),
    "demo": ("demo.cli", "the whole pipeline on the embedded pair: gen, train both heads, eval, export, one report"),
}

USAGE = "usage: specheads {" + ",".join(SUBCOMMANDS) + "} [options]   (specheads SUBCOMMAND --help)"


def main(argv: list[str] | None = None) -> int:
    """Run `specheads SUBCOMMAND ...`; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        for name, (_, what) in SUBCOMMANDS.items():
            print(f"  {name:8s} {what}")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"specheads: error: unknown subcommand {name!r}; known: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(argv[1:]) or 0)
    except UsageError as error:
        print(f"specheads {name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
