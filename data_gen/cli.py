"""`specheads gen`: the YAML config plus flag overrides, parsed by jsonargparse into `GenConfig`."""

from __future__ import annotations

from specheads.data_gen.config import FREE_DRAFTS, GenConfig
from specheads.plumbing.dataclass_cli import parse_dataclass

SHORTHANDS = {f"--{name}": f"--sampling.{name}" for name in ("max_new_tokens", "temperature", "top_k", "top_p")}


def parse_config(argv: list[str]) -> GenConfig:
    """Parse flags (and the YAML they name) into a `GenConfig`: `--config FILE` then any field
    (`--num-prompts`, `--sampling.temperature`, or the shorthand `--temperature`)."""
    return parse_dataclass(GenConfig, argv, "specheads gen", "Label token mixes from a draft/target pair.", SHORTHANDS)


def main(argv: list[str]) -> int:
    """Entry point for `specheads gen`."""
    config = parse_config(argv)
    if config.drafter is not None and config.drafter.kind in FREE_DRAFTS:  # a free draft: no draft model, one process
        from specheads.data_gen.lookup_labels import run_lookup as run
    else:
        from specheads.data_gen.run import run
    summary = run(config)
    if summary is not None:
        print(summary.text())
    return 0
