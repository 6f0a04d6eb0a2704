"""Policies judged at serving batch sizes: throughput of B concurrent requests (SV's goodput view).

At batch size 1 a drafted token that the target rejects costs only draft time. In a batch the target verifies
every row's candidates in one forward, so its cost grows with the candidates of all rows, and the draft runs
while any row still drafts. B requests are served together with continuous batching (a finished request's row
takes the next prompt of the queue), rounds in lockstep, and each round costs

    Σ_{s=1..max k} c_draft(rows drafting at step s) + c_target(Σ_rows (verified + 1)) + Σ_s c_head(tokens scored at s)

seconds (a row's first draft forward counts the tokens its draft had not read, its catch-up; a tree's s-th draft
forward counts the nodes it reads, its verified tokens are its nodes), with c(n) a model's forward time against the
tokens in the forward (`specheads.decoding.costs`), each forward priced on the rows live in it
(`CostCurve.price`: exactly for a roofline preset, by its tokens for a measured or given curve). The last term is the
acceptance head's, for a policy that reads one (the stop head, the head trees, the budget and goodput planners' head):
its curve measured beside the draft where there is one for that head (the measured view, or a table `specheads
profile --head` wrote for it), else the head's share of the draft's weights times the draft's curve; policies reading
free signals have none. In each
cost view asked for: the curves measured on the decoding device or given in a table, each also with the draft
`cost_ratio` times as costly as the target (the t_draft/t_target of the modelled speedups, a 7B/70B pair's view), and
the roofline presets (`CostTable.at_batch_size`). Throughput = tokens emitted / modelled seconds.

- **Batch policies** (the verify budget, SmartSpec's K) decide from the whole batch, so their rows interact: each B
  is decoded for real by the round engine with continuous batching, and priced from the rounds it ran.
- **Per-request policies** (constant K, SVIP, confidence, the head's stop rule, the oracle, the trees) decide per row
  with the row's own generator, so a request's rounds are the same whatever B (tests/test_batched.py and
  tests/test_tree_batched.py, float64): their test
  runs' rounds are served B at a time in the same lockstep and priced the same way.

Paired intervals: each round's seconds are shared equally by its rows (in lockstep every row waits for the whole
round), so a request has tokens and seconds; the prompts are resampled (a prompt's samples, `eval --test-samples`,
with it) and the ratio of throughputs recomputed.

SPRINTER is not served here: its target call checks one flagged token and lets the row's other drafted tokens pass
unverified, with no bonus token, and a row's last round may call no target at all, so its rounds are not the verify
rounds of k + 1 tokens this model prices; the table says so rather than leave it out without a word.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from specheads.decoding.costs import (
    CostCurve,
    RoundRecord,
    ServingCosts,
    chain_widths,
    measure_cost_curve,
    served_throughput,
)
from specheads.eval.sweep import grouped_rows, is_tree

__all__ = ["CostCurve", "measure_cost_curve"]

NOT_SERVED = {"sprinter": "SPRINTER's target call checks one flagged token and lets the other drafted tokens pass "
                          "unverified, so its rounds are not the verify rounds of k + 1 tokens this model prices",
              "sv_companion": "its companion runs a forward beside each draft forward, which this model's round cost "
                              "(draft steps and one target forward) does not price",
              "pmin": "a round p_min ends checks one candidate fewer than it drafted, and its runs record what was "
                      "drafted, not what was checked, so a replay would price the dropped candidate in the target's "
                      "forward"}
NOT_SERVED["dspark_confidence"] = NOT_SERVED["pmin"]  # p_min on the drafter's confidence: the same rounds
NOT_SERVED["dspark_confidence_ts"] = NOT_SERVED["pmin"]

PLANNED_BY_HEAD = ("goodput", "goodput_online", "budget")
"""The batch policies that plan with the trained expected-acceptance head (the budget head), judged against the others
decoded live."""

@dataclass
class LiveRun:
    """A batch policy's decode of the test prompts: its rounds, and how many of them its planner spent warming up
    (a signal still fitting itself drafts to the cap and checks every candidate: vLLM's adaptive verification until
    its third refit, one every 100 rounds)."""

    rounds: list[RoundRecord]
    warmup_rounds: int = 0
    refits: int | None = None  # how often its signal refitted from verify outcomes (None: a signal that does not)


LiveDecode = Callable[[str, float, int, ServingCosts], LiveRun]
"""(policy, threshold, batch size, costs) -> the test prompts decoded live at that batch size."""


def decode_live(engine: Any, prompts: list[list[int]], seeds: list[int], rule: Any, max_new_tokens: int, batch_size: int,
                costs: ServingCosts, head: Any = None) -> LiveRun:
    """`prompts` decoded by the round engine under the batch `rule`, `batch_size` at a time (continuous batching),
    its planner planning on `costs`: the rounds, and how many of them the planner spent warming up."""
    log: list[RoundRecord] = []
    planner = rule.planner(costs)
    engine.decode(prompts, rule, max_new_tokens, seeds, head, batch_size=batch_size, costs=costs, log=log, planner=planner)
    fit = getattr(getattr(planner, "signal", None), "fit", None)  # an estimate refitted while serving
    return LiveRun(log, getattr(planner, "warmup_rounds", 0), None if fit is None else fit.refits)


def warmup_record(run: LiveRun) -> dict[str, int] | None:
    """A live row's record of its planner's warm-up: its rounds and how many came after the warm-up (None for a
    planner that needs none)."""
    if not run.warmup_rounds:
        return None
    return {"rounds": len(run.rounds), "past_warmup": len(run.rounds) - run.warmup_rounds}


Round = tuple[int, int, list[int]] | tuple[int, int, list[int], list[int]]
"""A run's round as `replay` serves it: (candidates k, tokens yielded, the tokens of each draft forward[, the tokens its
head scored at each draft forward: none when left out])."""


def request_rounds(record: Any) -> list[Round]:
    """A run's rounds (`Round`): a + 1 tokens yielded each, the last one what the run emitted after the others (less
    where it ended at a stop token or at max_new_tokens); the draft forwards as the run recorded them (its catch-up
    first), or k forwards of one token for a chain run recorded before they were; with the head's scores where a head
    scored."""
    yielded = [a + 1 for a in record.accepted_per_round]
    if yielded:
        yielded[-1] = record.emitted - sum(yielded[:-1])
    widths = getattr(record, "draft_widths_per_round", None) or chain_widths(record.drafted_per_round)
    scored = getattr(record, "head_widths_per_round", None)
    return list(zip(record.drafted_per_round, yielded, widths, *([scored] if scored else [])))


def head_cost_of(records: list[Any]) -> float:
    """What one token a head scored in `records` costs, in draft forwards (their head forwards over their scores)."""
    scored = sum(getattr(r, "head_scored", 0) for r in records)
    return sum(getattr(r, "head_forwards", 0.0) for r in records) / scored if scored else 0.0


def replay(requests: list[list[Round]], batch_size: int, head_cost: float = 0.0) -> list[RoundRecord]:
    """The rounds of per-request runs (`request_rounds`) served `batch_size` at a time with continuous batching; a
    head's score costs `head_cost` draft forwards where no head curve prices it."""
    queue = deque((index, deque(rounds)) for index, rounds in enumerate(requests) if rounds)
    slots: list[tuple[int, deque]] = []
    log = []
    while queue or slots:
        while queue and len(slots) < batch_size:
            slots.append(queue.popleft())
        record = RoundRecord(head_cost=head_cost)
        for index, rounds in slots:
            drafted, yielded, widths, *scored = rounds.popleft()
            record.requests.append(index)
            record.drafted.append(drafted)
            record.verified.append(drafted)
            record.emitted.append(yielded)
            record.draft_widths.append(list(widths))
            record.head_widths.append(list(scored[0]) if scored else [])
        log.append(record)
        slots = [slot for slot in slots if slot[1]]
    return log


def serve(requests: list[list[Round]], batch_size: int, draft: CostCurve, target: CostCurve) -> dict[str, Any]:
    """Serve `requests` (each a list of rounds, `Round`) `batch_size` at a time; the modelled seconds, tokens and
    throughput (module docstring)."""
    return served_throughput(replay(requests, batch_size), ServingCosts(draft, target))


CostView = Callable[[int], ServingCosts]
"""A cost view: the curves that price a round of B requests, for each B (a roofline preset is modelled per B; measured
and given curves are the same at every B)."""


def serving_views(sources: list[tuple[str, CostView, bool]], cost_ratio: float) -> dict[str, CostView]:
    """The cost views of the serving table, by name: each source (name, view, scaled) as it is, and, where `scaled`
    (curves measured here or given for this pair), the same with the draft at `cost_ratio` × the target curve (a 7B/70B
    pair's view; a preset prices its own draft model). Names as `CostTable.view` gives them."""
    views: dict[str, CostView] = {}
    for name, view, scaled in sources:
        views[name] = view
        if scaled:
            prefix = "" if name == "measured" else f"{name}, "
            views[f"{prefix}draft at {cost_ratio:g} × target"] = (
                lambda size, view=view: view(size).scaled_draft(cost_ratio))
    return views


def paired_ratio_interval(policy: dict[Any, list[float]], baseline: dict[Any, list[float]], resamples: int,
                          seed: int) -> list[float] | None:
    """95 % interval of throughput(policy) / throughput(baseline) − 1 over resampled prompts (per-prompt tokens and
    seconds, keyed by prompt)."""
    prompts = sorted(set(policy) & set(baseline))
    if len(prompts) < 2 or not resamples:
        return None
    mine = np.array([policy[p] for p in prompts])
    theirs = np.array([baseline[p] for p in prompts])
    draws = np.random.default_rng(seed).integers(0, len(prompts), (resamples, len(prompts)))
    ratios = (mine[draws, 0].sum(1) / mine[draws, 1].sum(1)) / (theirs[draws, 0].sum(1) / theirs[draws, 1].sum(1)) - 1
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def serving_table(records: list[Any], tuned: dict[str, float], batch_sizes: list[int], views: dict[str, CostView],
                  live: LiveDecode | None = None, batch_policies: dict[str, float] | None = None, split: str = "test",
                  resamples: int = 1000, seed: int = 0, queue: list[str] | None = None,
                  head_curves: dict[tuple[str, str], CostCurve] | None = None) -> list[dict[str, Any]]:
    """Per policy, batch size and cost view: the modelled throughput of the `split` prompts served B at a time, its
    ratio to the tuned constant K's at the same B and view with a paired interval, and the share of the oracle's
    gain it captures. Per-request policies are served from their runs' rounds, `batch_policies` ({policy:
    threshold}) decoded by `live` (module docstring). `queue`, the prompt ids in the order `live` serves them,
    orders the runs the same way and groups a prompt's samples for the intervals; without it the runs' order is
    the queue and each request is its own prompt. `head_curves[(policy, view)]`, where given, is the measured curve of
    the head that policy reads in that view (module docstring); without `head_curves` the views' curves price as given."""

    def priced(policy: str, view: str, costs: ServingCosts) -> ServingCosts:
        return costs if head_curves is None else replace(costs, head=head_curves.get((policy, view)))

    rows = []
    position = {prompt: index for index, prompt in enumerate(queue or [])}
    for policy, threshold in tuned.items():
        runs = [r for r in records if r.split == split and r.policy == policy and r.threshold == threshold]
        if queue is not None:
            runs = sorted((r for r in runs if r.prompt_id in position), key=lambda r: position[r.prompt_id])
        if not runs or policy in NOT_SERVED or any(len(r.drafted_per_round) != len(r.accepted_per_round) for r in runs):
            continue
        if is_tree(policy) and any(r.drafted_per_round and not getattr(r, "draft_widths_per_round", None) for r in runs):
            continue  # runs from before trees recorded their draft forwards: they cannot be priced
        requests = [request_rounds(r) for r in runs]
        for size in batch_sizes:
            log = replay(requests, size, head_cost_of(runs))
            for view, costs in views.items():
                served = served_throughput(log, priced(policy, view, costs(size)))
                rows.append(table_row(policy, threshold, size, view, served, "replayed",
                                      None if queue is None else [r.prompt_id for r in runs]))
    for policy, threshold in (batch_policies or {}).items():
        for size in batch_sizes:
            decoded: dict[tuple, list[RoundRecord]] = {}
            for view, viewed in views.items():
                costs = priced(policy, view, viewed(size))
                key = (costs.target,) if policy == "budget" else (costs.draft, costs.target)  # the budget reads no draft cost
                if key not in decoded:
                    decoded[key] = live(policy, threshold, size, costs)
                run = decoded[key]
                row = table_row(policy, threshold, size, view, served_throughput(run.rounds, costs), "live", queue)
                rows.append({**row, **({"warmup": warmup_record(run)} if run.warmup_rounds else {}),
                             **({"refits": run.refits} if run.refits is not None else {})})
    compare(rows, resamples, seed)
    return rows


def table_row(policy: str, threshold: float, size: int, view: str, served: dict[str, Any], how: str,
              prompts: list[str] | None) -> dict[str, Any]:
    """One row of the table; its per-request tokens and seconds summed per prompt (request i serves `prompts[i]`;
    without `prompts` each request is its own) for the paired intervals."""
    requests = sorted(served["per_request"])
    per_prompt = served["per_request"]
    if prompts is not None:
        per_prompt = {group: list(row) for group, row in grouped_rows(
            [prompts[i] for i in requests], np.array([per_prompt[i] for i in requests]).reshape(-1, 2)).items()}
    return {"policy": policy, "threshold": threshold, "batch_size": size, "costs": view, "decoded": how,
            **served, "requests": len(requests), "per_request": per_prompt}


def compare(rows: list[dict[str, Any]], resamples: int, seed: int) -> None:
    """Each row's change against constant K at the same B and view (with its paired interval) and its share of the
    oracle's gain there; each live row's change against the best per-request policy and against every other batch
    policy decoded live there (`vs_live`: the planners fed other signals); the per-request shares are dropped from the
    rows once used."""
    for row in rows:
        same = {r["policy"]: r for r in rows if (r["batch_size"], r["costs"]) == (row["batch_size"], row["costs"])}
        constant, oracle = same.get("constant_k"), same.get("oracle")
        row["vs_constant_k"] = row["tokens_per_s"] / constant["tokens_per_s"] - 1 if constant else None
        row["vs_constant_k_ci"] = (paired_ratio_interval(row["per_request"], constant["per_request"], resamples, seed)
                                   if constant and row is not constant else None)
        gain = oracle["tokens_per_s"] - constant["tokens_per_s"] if oracle and constant else 0.0
        row["share_of_oracle_gain"] = (row["tokens_per_s"] - constant["tokens_per_s"]) / gain if gain > 0 else None
        if row["decoded"] == "live":
            rival = best_per_request(rows, row["batch_size"], row["costs"])
            row["best_per_request"] = rival["policy"] if rival else None
            row["vs_best_per_request"] = row["tokens_per_s"] / rival["tokens_per_s"] - 1 if rival else None
            row["vs_best_per_request_ci"] = (paired_ratio_interval(row["per_request"], rival["per_request"], resamples,
                                                                   seed) if rival else None)
            row["vs_live"] = {other["policy"]: {
                "change": row["tokens_per_s"] / other["tokens_per_s"] - 1,
                "ci": paired_ratio_interval(row["per_request"], other["per_request"], resamples, seed),
                **({"warmup": other["warmup"]} if "warmup" in other else {})}
                for other in same.values() if other["decoded"] == "live" and other is not row}
    for row in rows:
        row.pop("per_request")


def best_per_request(rows: list[dict[str, Any]], size: int, view: str) -> dict[str, Any] | None:
    """The per-request policy (served from its runs, the oracle aside) with the highest throughput at B and view: what
    a batch policy has to beat to be worth its coordination."""
    rivals = [r for r in rows if (r["batch_size"], r["costs"], r["decoded"]) == (size, view, "replayed")
              and r["policy"] != "oracle"]
    return max(rivals, key=lambda r: r["tokens_per_s"], default=None)


def best_per_batch_size(rows: list[dict[str, Any]]) -> dict[str, dict[int, str]]:
    """Per cost view, the policy with the highest throughput at each batch size (the oracle left out: it knows the
    outcomes)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["costs"], row["batch_size"])
        if row["policy"] != "oracle" and (key not in best or row["tokens_per_s"] > best[key]["tokens_per_s"]):
            best[key] = row
    result: dict[str, dict[int, str]] = {}
    for (view, size), row in sorted(best.items()):
        result.setdefault(view, {})[size] = row["policy"]
    return result
