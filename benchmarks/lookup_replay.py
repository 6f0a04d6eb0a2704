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
        --rule constant_k:8 --rule lookup_table:0.043 --rule lookup_plan:0.043 --head runs/lookup2/train-stop/head
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
from specheads.decoding import make_policy
from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.free_draft import FreePlanner
from specheads.decoding.free_rules import EstimatorPlanned
from specheads.decoding.online import Outcome
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST, linear_cost
from specheads.lookup.proposers import NO_PROPOSAL, Proposal, ngram_propose
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

ORACLE = "oracle"


def agreeing(tokens: tuple[int, ...], continuation: list[int]) -> int:
    """How many of `tokens` the output continues with (the longest common prefix)."""
    count = 0
    for proposed, output in zip(tokens, continuation):
        if proposed != output:
            break
        count += 1
    return count


def make_rule(rule: str, max_draft: int, head: str | None, curve: CostCurve | None = None) -> tuple[Any, Any]:
    """(policy, planner or None) of `name:value` (`oracle` has neither), planners reading the target's verify `curve`
    where given; refused in one line when malformed."""
    if rule == ORACLE:
        return None, None
    name, _, value = rule.partition(":")
    try:
        threshold = float(value)
    except ValueError:
        raise UsageError(f"--rule {rule!r} is not name:value (e.g. constant_k:8, lookup_table:0.043) or oracle") from None
    if name == "lookup_plan":
        if not head:
            raise UsageError("lookup_plan reads a token head: give --head DIR")
        policy = EstimatorPlanned(threshold=threshold, max_draft=max_draft, estimator=TokenHead.load(head, "lookup"))
    else:
        policy = make_policy(name, threshold, int(threshold) if name == "constant_k" else max_draft)
    costs = None if curve is None else ServingCosts(draft=curve, target=curve)  # a free draft runs no forward
    planner = policy.planner(costs) if hasattr(policy, "planner") else None
    return policy, planner if isinstance(planner, FreePlanner) else None


def verify_length(policy: Any, planner: Any, proposal: Proposal, continuation: list[int]) -> int:
    """How many proposed tokens the rule verifies this round (the oracle: those that will be accepted)."""
    if not proposal.tokens:
        return 0
    if policy is None:
        return agreeing(proposal.tokens, continuation)
    if planner is not None:
        length = planner.proposal_length(0, proposal, policy)
        planner.plan(0, proposal, length)
        return length
    return int(policy.proposal_length(proposal, None))


def replay(prompt: list[int], response: list[int], policy: Any, planner: Any, max_draft: int,
           price: Callable[[int], float]) -> tuple[float, int]:
    """(counted cost in one-token forwards, rounds) of decoding `response` after `prompt` under the rule, a round
    verifying k tokens priced `price(k + 1)`."""
    start, cost, rounds = 0, 0.0, 0
    if planner is not None:
        planner.admit(0)
    while start < len(response):
        room = len(response) - start  # the decoder's cap (`StopPolicy.cap`): the last slot is the bonus token's
        cap = min(max_draft, room - 1) if policy is None else policy.cap(room)
        proposal = ngram_propose([*prompt, *response[:start]], cap, len(prompt)) if cap > 0 else NO_PROPOSAL
        length = min(verify_length(policy, planner, proposal, response[start:]), len(proposal.tokens))
        accepted = agreeing(proposal.tokens[:length], response[start:])
        if planner is not None and length:
            checked = [Outcome(k + 1, 1.0, k < accepted) for k in range(min(accepted + 1, length))]
            planner.observe({0: checked})
        cost += price(length + 1)
        start += accepted + 1
        rounds += 1
    return cost, rounds


def geometric_interval(ratios: np.ndarray, resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The geometric mean of per-prompt ratios, its bootstrap 95 % interval over prompts and the count."""
    logs = np.log(ratios)
    draws = np.random.default_rng(seed).integers(0, len(logs), (resamples, len(logs)))
    means = np.exp(logs[draws].mean(1))
    return {"speedup": float(np.exp(logs.mean())), "interval": [float(np.percentile(means, 2.5)),
                                                               float(np.percentile(means, 97.5))],
            "prompts": len(logs)}


def summarise(speedups: dict[str, list[float]], families: list[str]) -> dict[str, dict[str, Any]]:
    """Per rule, overall and per family."""
    names = np.array(families)
    return {rule: {family: geometric_interval(np.array(values)[names == family] if family != "all" else np.array(values))
                   for family in ["all", *sorted(set(families))]}
            for rule, values in speedups.items()}


def run(labels: str, prompts: str, rules: list[str], head: str | None, max_draft: int,
        curve: CostCurve | None, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Every rule on every greedy response of `labels`, in the labels' order (online planners keep their state from
    prompt to prompt, as a server's do), forwards priced by the target's verify `curve` (None: 1 + t·k, t the
    prepacked CPU's `PACKED_CPU_TOKEN_COST`)."""
    rows = load_lookup(labels)
    sampling = (read_manifest(Path(labels)) or {}).get("identity", {}).get("sampling", {})
    if sampling.get("temperature") != 0.0:
        raise UsageError(f"{labels} was labelled at T = {sampling.get('temperature')}: a replay needs greedy responses "
                         "(specheads gen --temperature 0)")
    category = {record["id"]: record.get("category", "all")
                for record in map(json.loads, Path(prompts).read_text().splitlines()) if record}
    made = {rule: make_rule(rule, max_draft, head, curve) for rule in rules}
    price = linear_cost(PACKED_CPU_TOKEN_COST) if curve is None else (lambda n: curve(n) / curve(1))
    speedups: dict[str, list[float]] = {rule: [] for rule in rules}
    families = []
    for row in rows.select_columns(["prompt_id", "prompt_ids", "target_ids"]):
        families.append(category.get(row["prompt_id"], "unknown"))
        for rule, (policy, planner) in made.items():
            cost, _ = replay(list(row["prompt_ids"]), list(row["target_ids"]), policy, planner, max_draft, price)
            speedups[rule].append(len(row["target_ids"]) / cost)
        progress(f"{row['prompt_id']}: " + ", ".join(f"{rule} {values[-1]:.2f}x" for rule, values in speedups.items()))
    return {"labels": labels, "max_draft": max_draft, "verify_curve": None if curve is None else curve.as_dict(), "head": head,
            "summary": summarise(speedups, families)}


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
    parser.add_argument("--max-draft", type=int, default=32, help="the adaptive rules' most proposed tokens a round")
    parser.add_argument("--verify-curve", help="a benchmarks/lookup_decode.py results JSON: its measured verify_curve "
                        "prices the forwards and feeds the planners (default: 1 + t·k, t = PACKED_CPU_TOKEN_COST)")
    parser.add_argument("--out", help="a JSON of the summary")
    args = parser.parse_args(argv)
    if args.max_draft < 1:
        raise UsageError("--max-draft must be >= 1")
    curve = read_curve(args.verify_curve) if args.verify_curve else None
    for rule in args.rule:
        make_rule(rule, args.max_draft, args.head, curve)
    found = run(args.labels, args.prompts, args.rule, args.head, args.max_draft, curve)
    for rule, row in found["summary"].items():
        print(f"{rule}: " + ", ".join(f"{family} {v['speedup']:.3f}x [{v['interval'][0]:.3f}, {v['interval'][1]:.3f}]"
                                      for family, v in row.items()))
    if args.out:
        write_json_atomic(Path(args.out), found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
