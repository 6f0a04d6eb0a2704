"""`specheads export --ckpt CKPT --out DIR [--report DIR] [--into-dspark CHECKPOINT] [--push-to-hub REPO_ID] [--private]
[--revision BRANCH]`."""

from __future__ import annotations

from specheads.export.config import ExportConfig
from specheads.plumbing.dataclass_cli import parse_dataclass


def parse_config(argv: list[str]) -> ExportConfig:
    """Flags into an `ExportConfig`."""
    return parse_dataclass(ExportConfig, argv, "specheads export",
                           "Write a head folder (safetensors + config.json + model card), or with --into-dspark a copy of a "
                           "DSpark drafter with the head as its confidence head, and optionally push it to the Hub.")


def main(argv: list[str]) -> int:
    """Entry point for `specheads export`."""
    from specheads.export.run import export

    config = parse_config(argv)
    written = export(config)
    if config.into_dspark:
        print(f"wrote the {written['head']['head_type']} head into a copy of {config.into_dspark} at {config.out} "
              f"(calibration: {written['calibration_folded']})")
    else:
        rule = written["decision_rule"]
        print(f"exported {written['head_type']} to {config.out} (decision rule {rule['rule']} at {rule['threshold']:g}, "
              f"{'tuned' if rule['tuned'] else 'untuned'})")
    if "pushed_to" in written:
        print(f"pushed: {written['pushed_to']}")
    return 0
