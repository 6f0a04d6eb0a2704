"""`specheads export --ckpt CKPT --out DIR [--report DIR] [--push-to-hub REPO_ID] [--private] [--revision BRANCH]`."""

from __future__ import annotations

from specheads.export.config import ExportConfig
from specheads.plumbing.dataclass_cli import parse_dataclass


def parse_config(argv: list[str]) -> ExportConfig:
    """Flags into an `ExportConfig`."""
    return parse_dataclass(ExportConfig, argv, "specheads export",
                           "Write a head folder (safetensors + config.json + model card) and optionally push it to the Hub.")


def main(argv: list[str]) -> int:
    """Entry point for `specheads export`."""
    from specheads.export.run import export

    config = parse_config(argv)
    written = export(config)
    rule = written["decision_rule"]
    print(f"exported {written['head_type']} to {config.out} (decision rule {rule['rule']} at {rule['threshold']:g}, "
          f"{'tuned' if rule['tuned'] else 'untuned'})")
    if "pushed_to" in written:
        print(f"pushed: {written['pushed_to']}")
    return 0
