"""Wall clock of a DSpark drafter against the target alone at B = 1 (issue 63), rule by rule, with acceptance per
drafted position and paired intervals over prompts: benchmarks/eagle3_decode.py's counterpart.

    OMP_NUM_THREADS=1 python benchmarks/dspark_decode.py --drafter runs/dspark/drafter --prompts 40 \
        --rules '["constant_k:4", "constant_k:8", "confidence:0.3", "dspark_confidence:0.5", "tree:0.1"]'

On the held-out confirmation prompts, each prompt is decoded by the target alone and, for each rule, by the round
engine with `DSparkModel` as the draft (`specheads.decoding.dspark`: one block forward a round, at most the block's
candidates) at B = 1 (`specheads.eval.wall_clock`). `dspark_confidence:p` is llama.cpp's p_min on the drafter's own
confidence head (free: the block's forward computed it). Prints per rule tokens/s, the speedup over the target alone
with its 95 % interval over prompts, tokens and draft forwards a target call (at most one: a block a round), the
acceptance per drafted position and c = t_draft/t_target as the runs timed it (a block forward against a target
forward); `--out` writes them as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.eval.wall_clock import DrafterBenchmark, benchmark_drafter
from specheads.plumbing.dataclass_cli import parse_script


@dataclass
class DSparkBenchmark(DrafterBenchmark):
    """What to decode (`specheads.eval.wall_clock.DrafterBenchmark`), by default up to the block of DSpark's recipe
    (8) and p_min on the drafter's confidence beside the free rules.

    Args:
        rules: `name:threshold` chain rules (`dspark_confidence:p`: p_min on the drafter's confidence) and
            `tree:floor` trees.
        max_draft: a chain's K_max (the block caps it too).
    """

    rules: list[str] = field(default_factory=lambda: ["constant_k:4", "constant_k:8", "confidence:0.3",
                                                      "dspark_confidence:0.5", "tree:0.1"])
    max_draft: int = 8


def main() -> None:
    args = parse_script(DSparkBenchmark, "dspark_decode.py", "A DSpark drafter against the target alone at B = 1.")
    benchmark_drafter(args, "dspark")


if __name__ == "__main__":
    main()
