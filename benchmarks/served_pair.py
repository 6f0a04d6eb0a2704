"""Two per-request policies of one `specheads eval` report served against each other: each policy's test runs
replayed B at a time under a cost view (eval.serving.replay, as the report's serving table does) and the ratio of
their tokens/s with its paired 95 % interval over prompts. The report's table states each policy against constant K;
this states them against each other (e.g. the head-valued tree against the confidence-valued one), from the same runs.

    python benchmarks/served_pair.py --runs runs/serving/trees --policy tree_head_cost_n8 \
        --against tree_confidence_cost_n8 --costs "[h100-llama3.1-8b-llama3.2-1b]" --batch-sizes "[8, 32]"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specheads.decoding.cost_table import read_cost_table
from specheads.decoding.costs import served_throughput
from specheads.eval.reuse import read_records, saved_runs
from specheads.eval.serving import head_cost_of, paired_ratio_interval, replay, request_rounds, table_row
from specheads.plumbing.dataclass_cli import parse_script
from specheads.plumbing.errors import UsageError


@dataclass
class ServedPair:
    """What to compare.

    Args:
        runs: an eval's output folder (its runs.json).
        policy: the policy judged, as the report names it (`tree_head_cost_n8`, `head`, ...).
        against: the policy it is judged against.
        costs: cost views: roofline presets or cost tables (`specheads profile --out`).
        batch_sizes: the B to serve at.
        resamples: bootstrap resamples of prompts.
    """

    runs: str
    policy: str
    against: str
    costs: list[str] = field(default_factory=lambda: ["h100-llama3.1-8b-llama3.2-1b"])
    batch_sizes: list[int] = field(default_factory=lambda: [8, 32])
    resamples: int = 1000


def served(records: list, policy: str, size: int, table) -> tuple[float, dict[str, list[float]]]:
    """The policy's test runs served `size` at a time: tokens/s and each prompt's (tokens, seconds), a prompt's
    samples summed together as the report's table pairs them (`eval.serving.table_row`)."""
    runs = [r for r in records if r.split == "test" and r.policy == policy]
    log = replay([request_rounds(r) for r in runs], size, head_cost_of(runs))
    row = table_row(policy, runs[0].threshold, size, "", served_throughput(log, table.at_batch_size(size)), "replayed",
                    [r.prompt_id for r in runs])
    return row["tokens_per_s"], row["per_request"]


def main() -> None:
    args = parse_script(ServedPair, "served_pair.py", "Two policies of an eval report served against each other.")
    try:
        _, rows = saved_runs(args.runs, "its runs", "run that eval again")
        records = read_records(rows, Path(args.runs) / "runs.json", "run that eval again")
        policies = {r.policy for r in records if r.split == "test"}
        for name in (args.policy, args.against):
            if name not in policies:
                raise UsageError(f"{args.runs} has no test runs of {name}; choose among {', '.join(sorted(policies))}")
        tables = [read_cost_table(source, "--costs") for source in args.costs]
    except UsageError as error:
        raise SystemExit(f"served_pair.py: error: {error}") from None
    print(f"| view | B | {args.policy} tokens/s | {args.against} tokens/s | change [95 % paired] |\n|---|---|---|---|---|")
    for source, table in zip(args.costs, tables):
        for size in args.batch_sizes:
            mine, mine_per = served(records, args.policy, size, table)
            theirs, theirs_per = served(records, args.against, size, table)
            low, high = paired_ratio_interval(mine_per, theirs_per, args.resamples, 0) or (float("nan"),) * 2
            print(f"| {source} | {size} | {mine:.1f} | {theirs:.1f} | {mine / theirs - 1:+.1%} [{low:+.1%}, {high:+.1%}] |")


if __name__ == "__main__":
    main()
