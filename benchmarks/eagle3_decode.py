"""Wall clock of an EAGLE-3 drafter against the target alone at B = 1 (issue 61), rule by rule, with acceptance per
drafted position and paired intervals over prompts.

    OMP_NUM_THREADS=1 python benchmarks/eagle3_decode.py --drafter runs/eagle3/drafter --prompts 40 \
        --rules '["constant_k:2", "constant_k:3", "constant_k:4", "confidence:0.3", "svip:1.0", "tree:0.1"]'

`head:h` decodes a trained head's stop rule (`--head CHECKPOINT`, trained on data `specheads gen --config smollm2-eagle3`
labelled with this drafter), its forwards timed as they run.

On the held-out confirmation prompts (the drafter trains on the built-in ones), each prompt is decoded by the target
alone and, for each rule, by the round engine with `Eagle3Model` as the draft (`specheads.decoding.eagle3`) at B = 1
(`specheads.eval.wall_clock`, shared with benchmarks/dspark_decode.py). Prints per rule tokens/s, the speedup over the
target alone with its 95 % interval over prompts, tokens and draft forwards a target call, the acceptance per drafted
position (chains) and c = t_draft/t_target as the runs timed it; `--out` writes them as JSON.
"""

from __future__ import annotations

from specheads.eval.wall_clock import DrafterBenchmark, benchmark_drafter
from specheads.plumbing.dataclass_cli import parse_script


def main() -> None:
    args = parse_script(DrafterBenchmark, "eagle3_decode.py", "An EAGLE-3 drafter against the target alone at B = 1.")
    benchmark_drafter(args, "eagle3")


if __name__ == "__main__":
    main()
