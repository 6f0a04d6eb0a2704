"""`specheads eval --head CKPT_OR_DIR --data DIR --out DIR [--draft-kind lookup]`: offline metrics, decoding runs, report."""

from __future__ import annotations

from specheads.eval.config import EvalConfig
from specheads.plumbing.dataclass_cli import parse_dataclass


def parse_config(argv: list[str]) -> EvalConfig:
    """Flags (and an optional `--config` YAML) into an `EvalConfig`."""
    return parse_dataclass(EvalConfig, argv, "specheads eval",
                           "Evaluate an acceptance head: ROC/AUC, binary KL, calibration and decoding runs.")


def main(argv: list[str]) -> int:
    """Entry point for `specheads eval` (a free draft's token head: `eval.lookup`)."""
    config = parse_config(argv)
    if config.draft_kind != "model":
        from specheads.eval.lookup import evaluate_free

        lines = evaluate_free(config)
    else:
        from specheads.eval.run import evaluate

        lines = evaluate(config).verdict["text"]
    for line in lines:
        print(line)
    print(f"report: {config.out}/report.html")
    return 0
