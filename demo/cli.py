"""`specheads demo [--out DIR] [--quick] [--overwrite]`: the whole pipeline on the embedded pair."""

from __future__ import annotations

from specheads.demo.config import DemoConfig
from specheads.plumbing.dataclass_cli import parse_dataclass


def parse_config(argv: list[str]) -> DemoConfig:
    """Flags into a `DemoConfig`."""
    return parse_dataclass(DemoConfig, argv, "specheads demo",
                           "gen → train a SpecDec++ head and a SPRINTER verifier → eval both → export both, "
                           "on the embedded SmolLM2 pair; then prompt lookup's wall clock against the target alone.")


def main(argv: list[str]) -> int:
    """Entry point for `specheads demo`."""
    from specheads.demo.run import demo

    demo(parse_config(argv))
    return 0
