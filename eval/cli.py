"""`specheads eval --head CKPT_OR_DIR --data DIR --out DIR`: offline metrics, decoding runs, report."""

from __future__ import annotations

from specheads.eval.config import EvalConfig
from specheads.plumbing.dataclass_cli import parse_dataclass


def parse_config(argv: list[str]) -> EvalConfig:
    """Flags (and an optional `--config` YAML) into an `EvalConfig`."""
    return parse_dataclass(EvalConfig, argv, "specheads eval",
                           "Evaluate an acceptance head: ROC/AUC, binary KL, calibration and decoding runs.")


def main(argv: list[str]) -> int:
    """Entry point for `specheads eval`."""
    from specheads.eval.run import evaluate

    config = parse_config(argv)
    report = evaluate(config)
    for line in report.verdict["text"]:
        print(line)
    print(f"report: {config.out}/report.html")
    return 0
