"""Replay greedy decodes of a free draft (prompt lookup, SuffixDecoding's suffix drafts) under any rule, with no model
forward: the counted cost a rule would pay.

At T = 0 a point-mass draft is accepted exactly while it equals the target's greedy output, so the greedy response y of
a prompt (the `target_ids` of lookup labels, `specheads gen --drafter.kind lookup --temperature 0`) decides every round
of every exact decode of it: a round at output position s proposes from the prompt and y_<s (`ngram_propose`, the
decoder's `LookupDraft`; SuffixDecoding's trees for `suffix_own:p`, `suffix_plan:t`, `suffix_table:t` and `suffix_oracle`, one
`SuffixProposer` kept across a rule's requests as the decoder keeps it), the rule chooses how many of the proposed
tokens to verify (the rule objects and planners our decoder runs: `constant_k`, vLLM's online table, a token head's
cost-read planner), the round accepts the longest prefix that y continues with and ends one token later. A round
verifying k proposed tokens costs one target forward of k + 1 tokens, `price(k + 1)` one-token forwards; the target
alone costs 1 a token, so a rule's counted speedup on a prompt is |y| / its cost. `benchmarks/lookup_replay.py` and
`specheads eval --draft-kind lookup` both replay through this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from specheads.decoding import make_policy
from specheads.decoding.costs import CostCurve, RoundRecord
from specheads.decoding.free_draft import FreePlanner
from specheads.decoding.free_rules import HEAD_RULES
from specheads.decoding.online import Outcome
from specheads.decoding.rules import RULES
from specheads.decoding.verify_curve import free_draft_costs
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST, linear_cost
from specheads.lookup.proposers import NO_PROPOSAL, Proposal, SuffixProposer, accepted_prefix, ngram_propose
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError

ORACLE = "oracle"
SUFFIX_ORACLE = "suffix_oracle"
"""The oracle on SuffixDecoding's proposals (as its own rule cuts them: the headroom any stop rule has over it)."""
SUFFIX_PLAN = "suffix_plan"
"""`lookup_plan` on SuffixDecoding's proposals read further (`SUFFIX_PLAN_DRAFT`), fed a token head trained on suffix
drafts (`specheads gen --drafter.kind suffix`): the decoder takes the draft kind apart from the rule, the replay and the
wall clock by name."""
SUFFIX_FURTHER = {SUFFIX_PLAN: "lookup_plan", "suffix_table": "lookup_table"}
"""The rules on suffix drafts read further (`SUFFIX_PLAN_DRAFT`), each the decoder's rule it runs there: the head's
planner and, free, vLLM's online table on the same drafts (what the head has to beat on them)."""
SUFFIX_PLAN_DRAFT = {"max_spec_factor": 4.0, "min_token_prob": 0.0}
"""The suffix drafts `suffix_plan` cuts: SuffixDecoding's tree read further than its own rule reads it (factor 1,
tokens of probability 0.1 and up), up to 4 × the match length and with no floor on probability, so that the head has
more to choose from (chosen on the dev prompts' replay, against factor 2 with floor 0.01)."""


def reads_suffix(rule: str) -> bool:
    """Whether `rule` reads SuffixDecoding's proposals (`suffix_own:p`, `suffix_plan:t`, `suffix_table:t`,
    `suffix_oracle`) rather than prompt lookup's."""
    return rule == SUFFIX_ORACLE or rule.startswith(("suffix_own:", *(f"{name}:" for name in SUFFIX_FURTHER)))


def suffix_settings(rule: str) -> dict[str, float]:
    """The suffix proposer's settings `rule` reads (`SUFFIX_PLAN_DRAFT` for the `SUFFIX_FURTHER` rules; none,
    SuffixDecoding's defaults, otherwise): `SuffixProposer` and `LookupDraft` take them alike."""
    return dict(SUFFIX_PLAN_DRAFT) if rule.partition(":")[0] in SUFFIX_FURTHER else {}


def decoder_rule(name: str) -> str:
    """The decoder's rule a rule named `name` runs (`suffix_plan` is `lookup_plan` on suffix drafts read further)."""
    return SUFFIX_FURTHER.get(name, name)


def head_rule(name: str) -> Any | None:
    """The rule class of a rule named `name` that reads a token head, else None."""
    return RULES[decoder_rule(name)] if decoder_rule(name) in HEAD_RULES else None


def make_rule(rule: str, max_draft: int, head: str | None, curve: CostCurve | None = None) -> tuple[Any, Any]:
    """(policy, planner or None) of `name:value` (`oracle` has neither), planners reading the target's verify `curve`
    where given; refused in one line when malformed. `head`: the token head a head rule reads, trained on the draft
    kind the rule reads (`reads_suffix`)."""
    if rule in (ORACLE, SUFFIX_ORACLE):
        return None, None
    name, _, value = rule.partition(":")
    try:
        threshold = float(value)
    except ValueError:
        raise UsageError(f"--rule {rule!r} is not name:value (e.g. constant_k:8, lookup_table:0.043) or oracle") from None
    if head_rule(name) is not None:
        kind = "suffix" if reads_suffix(rule) else "lookup"
        if not head:
            raise UsageError(f"{name} reads a token head: give --{'suffix-' if kind == 'suffix' else ''}head DIR")
        policy = head_rule(name)(threshold=threshold, max_draft=max_draft, estimator=TokenHead.load(head, kind))
    else:
        policy = make_policy(decoder_rule(name), threshold, int(threshold) if name == "constant_k" else max_draft)
    costs = None if curve is None else free_draft_costs(curve)
    planner = policy.planner(costs) if hasattr(policy, "planner") else None
    return policy, planner if isinstance(planner, FreePlanner) else None


def verify_length(policy: Any, planner: Any, proposal: Proposal, continuation: list[int]) -> int:
    """How many proposed tokens the rule verifies this round (the oracle: those that will be accepted)."""
    if not proposal.tokens:
        return 0
    if policy is None:
        return accepted_prefix(proposal.tokens, continuation)
    if planner is not None:
        length = planner.proposal_length(0, proposal, policy)
        planner.plan(0, proposal, length)
        return length
    return int(policy.proposal_length(proposal, None))


def replayed_rounds(prompt: list[int], response: list[int], policy: Any, planner: Any, max_draft: int,
                    propose: int | None = None, suffix: SuffixProposer | None = None,
                    request: int = 0) -> Iterator[tuple[int, int, int]]:
    """(tokens proposed, tokens verified, tokens accepted) of every round of decoding `response` after `prompt` under
    the rule, in order. `propose`: the proposer's K where it drafts more than the rule's cap verifies (a server's
    proposer reading 32 tokens under a fixed K = 8), None: the rule's cap. `suffix`: SuffixDecoding's proposer (the
    request `request` of it), None: prompt lookup's."""
    start = 0
    if planner is not None:
        planner.admit(0)
    if suffix is not None:
        suffix.start(request, prompt)
    while start < len(response):
        room = len(response) - start  # the decoder's cap (`StopPolicy.cap`): the last slot is the bonus token's
        cap = min(max_draft, room - 1) if policy is None else policy.cap(room)
        reach = cap if propose is None else min(propose, room - 1)
        context = [*prompt, *response[:start]]
        proposal = NO_PROPOSAL if reach <= 0 else (
            suffix.propose(request, context, reach) if suffix is not None else ngram_propose(context, reach, len(prompt)))
        length = min(verify_length(policy, planner, proposal, response[start:]), len(proposal.tokens), cap)
        accepted = accepted_prefix(proposal.tokens[:length], response[start:])
        if planner is not None and length:
            checked = [Outcome(k + 1, 1.0, k < accepted) for k in range(min(accepted + 1, length))]
            planner.observe({0: checked})
        yield len(proposal.tokens), length, accepted
        if suffix is not None:
            suffix.extend(request, response[start : start + accepted + 1])
        start += accepted + 1
    if suffix is not None:
        suffix.stop(request)


def replay(prompt: list[int], response: list[int], policy: Any, planner: Any, max_draft: int,
           price: Callable[[int], float], suffix: SuffixProposer | None = None,
           request: int = 0) -> tuple[float, int]:
    """(counted cost in one-token forwards, rounds) of decoding `response` after `prompt` under the rule, a round
    verifying k tokens priced `price(k + 1)`; `suffix` and `request` as `replayed_rounds`'s."""
    verified = [length for _, length, _ in replayed_rounds(prompt, response, policy, planner, max_draft,
                                                           suffix=suffix, request=request)]
    return sum(price(length + 1) for length in verified), len(verified)


def round_log(responses: Iterable[tuple[list[int], list[int]]], policy: Any, planner: Any, max_draft: int,
              propose: int | None = None) -> tuple[list[RoundRecord], list[list[int]]]:
    """What our decoder's round log records of the rule's decodes of every (prompt, greedy response), request i the
    i-th: one `RoundRecord` a round (its verified and emitted tokens) and the tokens its proposal held, row for row
    (`specheads.train.lookup_logs.decoder_log_lines` writes them); `propose` as `replayed_rounds`'s."""
    records, proposed = [], []
    for request, (prompt, response) in enumerate(responses):
        for count, length, accepted in replayed_rounds(list(prompt), list(response), policy, planner, max_draft,
                                                       propose):
            records.append(RoundRecord(requests=[request], drafted=[length], verified=[length],
                                       emitted=[accepted + 1]))
            proposed.append([count])
    return records, proposed


def geometric_speedup(ratios: np.ndarray, resamples: int, seed: int = 0,
                      least: int = 2) -> tuple[float, list[float] | None]:
    """The geometric mean of per-prompt speedups (nan for none) and its bootstrap 95 % interval over prompts (None
    under `least` prompts or without resamples). The replay, the wall-clock benchmark and the demo's line share it."""
    logs = np.log(ratios)
    if not resamples or len(logs) < max(least, 1):
        return (float(np.exp(logs.mean())) if len(logs) else float("nan")), None
    means = np.exp(logs[np.random.default_rng(seed).integers(0, len(logs), (resamples, len(logs)))].mean(1))
    return float(np.exp(logs.mean())), [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def geometric_interval(ratios: np.ndarray, resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The geometric mean of per-prompt ratios, its bootstrap 95 % interval over prompts (from one prompt on) and the
    count."""
    speedup, interval = geometric_speedup(ratios, resamples, seed, least=1)
    return {"speedup": speedup, "interval": interval, "prompts": len(ratios)}


def summarise(speedups: dict[str, list[float]], families: list[str], resamples: int = 1000,
              seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per rule, overall and per family."""
    names = np.array(families)
    return {rule: {family: geometric_interval(np.array(values)[names == family] if family != "all" else np.array(values),
                                              resamples, seed)
                   for family in ["all", *sorted(set(families))]}
            for rule, values in speedups.items()}


def greedy_refusal(manifest: dict[str, Any] | None, labels: str) -> str | None:
    """Why the lookup labels of `manifest` cannot be replayed (not labelled at T = 0), or None when they can."""
    temperature = ((manifest or {}).get("identity", {}).get("sampling") or {}).get("temperature")
    if temperature == 0.0:
        return None
    return (f"{labels}: labelled at T = {temperature}, not greedy; a replay needs greedy responses: give lookup labels "
            "made with `specheads gen --drafter.kind lookup --temperature 0`")


def forward_price(curve: CostCurve | None) -> Callable[[int], float]:
    """A verify of n tokens in one-token forwards: the target's `curve` where given, else 1 + t·(n − 1) with t the
    prepacked CPU's `PACKED_CPU_TOKEN_COST`."""
    return linear_cost(PACKED_CPU_TOKEN_COST) if curve is None else (lambda n: curve(n) / curve(1))


def replay_speedups(responses: Iterable[tuple[list[int], list[int]]], rules: list[str], head: str | None,
                    max_draft: int, curve: CostCurve | None = None,
                    progress: Callable[[dict[str, list[float]]], None] = lambda found: None,
                    suffix_head: str | None = None) -> dict[str, list[float]]:
    """Every rule's counted speedup on every (prompt, greedy response), in the given order (online planners and
    SuffixDecoding's global tree keep their state from prompt to prompt, as a server's do), forwards priced by
    `forward_price(curve)`; `suffix_head` is the head `suffix_plan` reads."""
    made = {rule: make_rule(rule, max_draft, suffix_head if reads_suffix(rule) else head, curve) for rule in rules}
    trees = {rule: SuffixProposer(**suffix_settings(rule)) for rule in rules if reads_suffix(rule)}
    price = forward_price(curve)
    speedups: dict[str, list[float]] = {rule: [] for rule in rules}
    for request, (prompt, response) in enumerate(responses):
        for rule, (policy, planner) in made.items():
            cost, _ = replay(list(prompt), list(response), policy, planner, max_draft, price, trees.get(rule), request)
            speedups[rule].append(len(response) / cost)
        progress(speedups)
    return speedups
