"""Choose `lookup_plan_online`'s rate and half-life on the DEV prompts' switching queue (counted replay at T = 0, no
forward; `specheads.decoding.free_rules.ONLINE_SHIFT_RATE` and `ONLINE_SHIFT_HALF_LIFE` hold the choice): the queue of
benchmarks/lookup_loop.py (blocks of one family, code edits, passages, chats, open questions, twice), every rule's
state carried along it, each round priced by the verify curve; per setting the paired ratio to vLLM's table pooled
over the blocks after a switch, its worst block, and every block. The choice: the best worst block, then the best
pooled ratio.

    python benchmarks/lookup_online_rate.py --labels runs/lookup2/gen-dev-t0 --prompts benchmarks/prompts/lookup-dev.jsonl \
        --head heads/shipped/smollm2-lookup --verify-curve runs/lookup2/wallclock-t0.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from lookup_loop import requests_of
from lookup_replay import read_curve

from specheads.decoding.free_replay import forward_price, make_rule, replay
from specheads.decoding.free_rules import OnlineEstimatorPlanned
from specheads.decoding.verify_curve import free_draft_costs
from specheads.lookup.token_head import TokenHead
from specheads.train.lookup_loop import switching_queue

RATES = (0.01, 0.03, 0.1, 0.3)
HALF_LIVES = (64, 256)
ORDER = ["code-edit", "passage", "chat-repeat", "open"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", required=True, help="dev lookup labels at T = 0 (the queue's greedy responses)")
    parser.add_argument("--prompts", required=True, help="their prompts' JSONL (its `category` is the family)")
    parser.add_argument("--head", required=True, help="the token head")
    parser.add_argument("--verify-curve", required=True, help="a benchmarks/lookup_decode.py results JSON")
    args = parser.parse_args(argv)
    curve = read_curve(args.verify_curve)
    price = forward_price(curve)
    blocks = switching_queue(requests_of(args.labels, args.prompts), ORDER, 2)
    queue = [request for block in blocks for request in block]
    ends = np.cumsum([0, *map(len, blocks)])

    def speedups(policy, planner) -> np.ndarray:
        return np.array([len(r.response) / replay(r.prompt, r.response, policy, planner, 32, price)[0] for r in queue])

    table = speedups(*make_rule("lookup_table:0.043", 32, None, curve))

    def report(name: str, values: np.ndarray) -> None:
        logs = np.log(values / table)
        blocks_ratio = [float(np.exp(logs[ends[i]:ends[i + 1]].mean())) for i in range(len(blocks))]
        print(f"{name}: pooled after a switch {np.exp(logs[ends[1]:].mean()):.3f}, worst block "
              f"{min(blocks_ratio[1:]):.3f}, blocks " + " ".join(f"{b:.3f}" for b in blocks_ratio), flush=True)

    report("lookup_plan (no shift)", speedups(*make_rule("lookup_plan:0.043", 32, args.head, curve)))
    head = TokenHead.load(args.head, "lookup")
    for half_life in HALF_LIVES:
        for rate in RATES:
            policy = OnlineEstimatorPlanned(threshold=0.043, max_draft=32, estimator=head, rate=rate,
                                            half_life=half_life)
            report(f"rate {rate}, half-life {half_life}", speedups(policy, policy.planner(free_draft_costs(curve))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
