"""Replay greedy decodes of prompt lookup under any rule, with no model forward: the counted speedup a rule would get.

At T = 0 a point-mass draft is accepted exactly while it equals the target's greedy output, so the greedy response y
of a prompt (the `target_ids` of lookup labels, `specheads gen --drafter.kind lookup --temperature 0`) decides every
round of every exact decode of it: a round at output position s proposes from the prompt and y_<s
(`ngram_propose`, the decoder's `LookupDraft`), the rule chooses how many of the proposed tokens to verify (the same
rule objects and planners our decoder runs: `constant_k`, vLLM's online table, a token head's cost-read planner),
the round accepts the longest prefix that y continues with and ends one token later. A round that verifies k
proposed tokens costs one target forward of k + 1 tokens, priced 1 + t·k one-token forwards (t = a verified token's
cost on this CPU with prepacked weights, `PACKED_CPU_TOKEN_COST`); the target alone costs 1 a token. So the counted
speedup of a rule on a prompt is |y| / Σ rounds (1 + t·k), its geometric mean over prompts and per family is
reported with a bootstrap 95 % interval, and so is an oracle that verifies exactly the tokens that will be accepted.

It prices forwards only: the wall clock also pays the proposal's search, the head's forward and the decoder's
bookkeeping per round (`benchmarks/lookup_decode.py` measures them). It is the quick way to choose on dev labels
what the wall clock then confirms on prompts never used for a choice.

    python benchmarks/lookup_replay.py --labels runs/lookup2/gen-dev-t0 --prompts benchmarks/prompts/lookup-dev.jsonl \
        --rule constant_k:8 --rule lookup_table:0.043 --rule lookup_plan:0.043 --head runs/lookup2/train-stop/head \
        --compare lookup_plan:0.043/lookup_table:0.043

SuffixDecoding's drafts replay under `suffix_own:p`, `suffix_oracle` and `suffix_plan:t`, the cost-read planner fed
a token head trained on suffix drafts (`--suffix-head`) (`specheads.decoding.free_replay`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specheads.dataset.lookup import load_lookup
from specheads.dataset.store import read_manifest
from specheads.decoding.costs import CostCurve
from specheads.decoding.free_replay import (  # noqa: F401  (the replay's names, as tests/test_lookup_replay.py reads them)
    ORACLE,
    accepted_prefix,
    geometric_interval,
    greedy_refusal,
    make_rule,
    reads_suffix,
    replay,
    replay_speedups,
    summarise,
    verify_length,
)
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic


def run(labels: str, prompts: str, rules: list[str], head: str | None, max_draft: int,
        curve: CostCurve | None, progress: Callable[[str], None] = lambda line: None,
        suffix_head: str | None = None) -> dict[str, Any]:
    """Every rule on every greedy response of `labels`, in the labels' order (`replay_speedups`), forwards priced by
    the target's verify `curve` (None: 1 + t·k, t the prepacked CPU's `PACKED_CPU_TOKEN_COST`)."""
    rows = load_lookup(labels)
    refusal = greedy_refusal(read_manifest(Path(labels)), labels)
    if refusal:
        raise UsageError(refusal)
    category = {record["id"]: record.get("category", "all")
                for record in map(json.loads, Path(prompts).read_text().splitlines()) if record}
    rows = rows.select_columns(["prompt_id", "prompt_ids", "target_ids"])
    ids = list(rows["prompt_id"])

    def report(found: dict[str, list[float]]) -> None:
        index = len(next(iter(found.values()))) - 1
        progress(f"{ids[index]}: " + ", ".join(f"{rule} {values[-1]:.2f}x" for rule, values in found.items()))

    speedups = replay_speedups(((row["prompt_ids"], row["target_ids"]) for row in rows), rules, head, max_draft, curve,
                               report, suffix_head)
    families = [category.get(prompt_id, "unknown") for prompt_id in ids]
    return {"labels": labels, "max_draft": max_draft, "verify_curve": None if curve is None else curve.as_dict(), "head": head,
            "suffix_head": suffix_head, "summary": summarise(speedups, families), "prompt_ids": ids, "per_prompt": speedups}


def paired(found: dict[str, Any], pairs: list[str]) -> dict[str, dict[str, Any]]:
    """Per `A/B` pair of rules: the geometric mean over prompts of A's speedup over B's on the same prompt, with its
    bootstrap 95 % interval (`geometric_interval`)."""
    per_prompt = found["per_prompt"]
    return {pair: geometric_interval(np.array(per_prompt[mine]) / np.array(per_prompt[theirs]))
            for pair in pairs for mine, theirs in [pair.split("/")]}


def read_curve(path: str) -> CostCurve:
    """The verify curve a benchmarks/lookup_decode.py results JSON holds; refused in one line otherwise."""
    try:
        stored = json.loads(Path(path).read_text())["verify_curve"]
        return CostCurve(tuple(stored["tokens"]), tuple(stored["seconds"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--verify-curve {path}: no verify_curve read ({error}); give a lookup_decode.py results "
                         "JSON") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", required=True, help="lookup labels at T = 0 (their prompts and greedy responses)")
    parser.add_argument("--prompts", required=True, help="the prompts' JSONL (its `category` is the family)")
    parser.add_argument("--rule", action="append", required=True, help="name:value, or oracle (repeatable)")
    parser.add_argument("--head", help="the token head lookup_plan reads")
    parser.add_argument("--suffix-head", help="the token head suffix_plan reads (trained on suffix drafts)")
    parser.add_argument("--max-draft", type=int, default=32, help="the adaptive rules' most proposed tokens a round")
    parser.add_argument("--verify-curve", help="a benchmarks/lookup_decode.py results JSON: its measured verify_curve "
                        "prices the forwards and feeds the planners (default: 1 + t·k, t = PACKED_CPU_TOKEN_COST)")
    parser.add_argument("--compare", action="append", default=[],
                        help="A/B: two of the rules, A's speedup over B's paired per prompt (repeatable)")
    parser.add_argument("--out", help="a JSON of the summary")
    args = parser.parse_args(argv)
    if args.max_draft < 1:
        raise UsageError("--max-draft must be >= 1")
    for pair in args.compare:
        if len(pair.split("/")) != 2 or not set(pair.split("/")) <= set(args.rule):
            raise UsageError(f"--compare {pair!r} is not A/B with A and B two of the --rule values "
                             "(e.g. lookup_plan:0.043/lookup_table:0.043)")
    curve = read_curve(args.verify_curve) if args.verify_curve else None
    for rule in args.rule:
        make_rule(rule, args.max_draft, args.suffix_head if reads_suffix(rule) else args.head, curve)
    found = run(args.labels, args.prompts, args.rule, args.head, args.max_draft, curve, suffix_head=args.suffix_head)
    for rule, row in found["summary"].items():
        print(f"{rule}: " + ", ".join(f"{family} {v['speedup']:.3f}x [{v['interval'][0]:.3f}, {v['interval'][1]:.3f}]"
                                      for family, v in row.items()))
    found["paired"] = paired(found, args.compare)
    for pair, row in found["paired"].items():
        print(f"{pair}: {row['speedup']:.3f} [{row['interval'][0]:.3f}, {row['interval'][1]:.3f}] over {row['prompts']} "
              "prompts")
    if args.out:
        write_json_atomic(Path(args.out), found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
