"""Serve prompt lookup's free drafts at B rows with no model forward: the batch planner sized from vLLM's online table,
from the token-only head, from a constant K and from an oracle, priced by a cost view (issue 71, item 6's serving table).

The principle is benchmarks/lookup_replay.py's: at T = 0 a point-mass draft is accepted exactly while it equals the
target's greedy output, so the greedy response y of each prompt (the `target_ids` of lookup labels at T = 0) decides
every round. Requests are served B at a time with continuous batching: when a request ends, the next in the queue
takes its row (the labels' prompts in order, cycled: each prompt served `ceil(turnover · B / prompts)` times, so each
row serves about `turnover` requests); the run stops at the end of the first round a row finishes with no request left
to take it, so that every counted round has B live rows. Each round:

- every row at output position s proposes `ngram_propose(prompt + y[:s], min(max_draft, room − 1), len(prompt))` (the
  decoder's `LookupDraft` rule and cap: the last slot is the round's own token);
- a rule gives each row's verify length k_r. The planned rules feed the batch planner
  `specheads.decoding.planners.goodput_verify_lengths` (SV's greedy: the batch's expected tokens over the forward's
  price) each row's survival products S_j = Π_{i≤j} â_i, the conditional estimates â_i read from
  `table`: vLLM's online acceptance table (`specheads.decoding.free_rules.TablePlanner`, the class our decoder runs:
      counts per (source, length bucket, position) shared across rows, updated from the verified positions, halved
      every 1024 rounds of the batch),
  `head`: the token-only head (`TokenHead.load(--head, "lookup").estimates(proposal)`),
  `oracle`: 1 for each proposed token the response continues with (the positions beyond are not offered);
  `table_warm` (with `--warm-labels`): the same table, first fed the rounds of one request of each of other
      labels' prompts (dev's) served at the same B and curve verifying every proposed token: vLLM's table starts at
      1/2 everywhere, and where a curve makes 1/2 not worth a verified token the planner verifies nothing and the
      table never learns (a cold start that a server's table, running for hours, may have left behind);
  `constant_k` verifies min(K, proposal) tokens, no planner (vLLM ngram's and transformers' rule);
- the round costs the target's forward of Σ_r (k_r + 1) tokens over B rows (`CostCurve.price`), and each row
  emits the longest prefix of its verified tokens that y continues with, plus one token.

Throughput is the tokens emitted over the summed round prices; each rule's is reported over the target alone's (B
rows, one token each a round, priced `price(B, B)`), and the head's over the table's. Cost views: the roofline presets
of `specheads.decoding.cost_table.PRESETS` (`roofline_costs(preset, context, B)`, each forward priced on its B rows'
cache reads at one context: `--context`, by default the labels' mean prompt length plus half their mean response
length) and this CPU's measured verify curve (`--verify-curve`, benchmarks/lookup_decode.py's results JSON: one
request's forward of n tokens; here it prices a B-row forward of n tokens in all, by its tokens alone, linear beyond
its last point). The interval is a bootstrap over prompts (`--resamples`), paired between rules: each round's price is
shared among its rows in proportion to the tokens each put into the forward (k_r + 1), each request's tokens and share
summed per prompt, and the ratio of sums taken over prompts drawn with replacement. It holds the batch's rounds as
served (the draw does not re-serve the batch), so it measures the prompt mix's spread, not the batch's interplay.

It prices forwards only: a server also pays the proposal's search, the head's forward and its own bookkeeping per
round (benchmarks/lookup_decode.py measures them at B = 1).

    OMP_NUM_THREADS=1 python benchmarks/lookup_serving.py --labels runs/lookup2/gen-confirm-t0 \
        --warm-labels runs/lookup2/gen-dev-t0 --head runs/lookup2/train-stop/head \
        --verify-curve runs/lookup2/wallclock-t0.json --out runs/lookup2/serving-confirm-t0.json
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse.typing import NonNegativeInt, PositiveInt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script lookup_replay.py

from lookup_replay import read_curve  # noqa: E402

from specheads.dataset.store import read_manifest  # noqa: E402
from specheads.decoding import make_policy  # noqa: E402
from specheads.decoding.cost_table import PRESETS, roofline_costs  # noqa: E402
from specheads.decoding.costs import CostCurve  # noqa: E402
from specheads.decoding.free_replay import greedy_refusal  # noqa: E402
from specheads.decoding.online import Outcome  # noqa: E402
from specheads.decoding.planners import goodput_verify_lengths  # noqa: E402
from specheads.lookup.proposers import NO_PROPOSAL, Proposal, accepted_prefix, ngram_propose  # noqa: E402
from specheads.plumbing.dataclass_cli import parse_script  # noqa: E402
from specheads.plumbing.errors import UsageError  # noqa: E402
from specheads.plumbing.files import write_json_atomic  # noqa: E402

TABLE, TABLE_WARM, HEAD, ORACLE, CONSTANT_K = "table", "table_warm", "head", "oracle", "constant_k"
CPU_VIEW = "cpu"


@dataclass
class Config:
    """What to serve.

    Args:
        labels: lookup labels at T = 0 (`specheads gen --drafter.kind lookup --temperature 0`): prompts and greedy
            responses.
        head: the token-only head (an exported `lookup_token_stop` or `lookup_token_expected` folder) fed to the planner.
        batch_sizes: the B rows served together, one run each.
        presets: the roofline presets priced (`specheads.decoding.cost_table.PRESETS`).
        verify_curve: a benchmarks/lookup_decode.py results JSON whose `verify_curve` is this CPU's view (none: the
            presets only).
        max_draft: the most proposed tokens a row's round may verify.
        constant_k: the constant-K reference's K.
        turnover: requests each row serves on average (the queue's length over B).
        context: cached tokens a row reads in the presets' forwards (0: the labels' mean prompt plus half their mean
            response).
        resamples: bootstrap draws over prompts for the intervals (0: none).
        warm_labels: other lookup labels at T = 0 (dev's) that warm a second copy of vLLM's table, `table_warm`, before
            it serves: one request of each, served at the same B and curve, verifying every proposed token.
        out: a JSON of every figure (written atomically).
    """

    labels: str
    head: str
    batch_sizes: list[PositiveInt] = field(default_factory=lambda: [8, 32, 64, 128, 256])
    presets: list[str] = field(default_factory=lambda: list(PRESETS))
    verify_curve: str | None = None
    max_draft: PositiveInt = 32
    constant_k: PositiveInt = 8
    turnover: PositiveInt = 4
    context: NonNegativeInt = 0
    resamples: NonNegativeInt = 1000
    warm_labels: str | None = None
    out: str | None = None

    def check(self) -> None:
        """Refuse bad flags in one line before anything is served."""
        unknown = [name for name in self.presets if name not in PRESETS]
        if unknown:
            raise UsageError(f"--presets {', '.join(unknown)}: not a roofline preset; give any of {', '.join(PRESETS)}")
        if not self.batch_sizes:
            raise UsageError("--batch-sizes is empty; give one B or more, e.g. [8,32]")
        if not self.presets and not self.verify_curve:
            raise UsageError("no cost view: give --presets or --verify-curve")
        for flag, labels in (("--labels", self.labels), ("--warm-labels", self.warm_labels)):
            refusal = greedy_refusal(read_manifest(Path(labels)), f"{flag} {labels}") if labels else None
            if refusal:
                raise UsageError(refusal)


@dataclass
class Request:
    """One request in a row: its prompt's index in the labels, and how far its response is emitted."""

    prompt: int
    start: int = 0


class Responses:
    """The labels' prompts and greedy responses, each (prompt, position)'s proposal and head estimates read once and
    shared by every rule, B and view (a proposal is a function of the verified context)."""

    def __init__(self, pairs: Sequence[tuple[list[int], list[int]]], max_draft: int, head: Any = None) -> None:
        self.pairs, self.max_draft, self.head = [pair for pair in pairs if pair[1]], max_draft, head
        if not self.pairs:
            raise UsageError("the labels hold no response to serve; label prompts with `specheads gen`")
        self.proposals: dict[tuple[int, int], Proposal] = {}
        self.head_estimates: dict[tuple[int, int], list[float]] = {}

    def proposal(self, request: Request) -> Proposal:
        """The request's proposal at its position (`ngram_propose`, capped at min(max_draft, room − 1))."""
        key = (request.prompt, request.start)
        if key not in self.proposals:
            prompt, response = self.pairs[request.prompt]
            cap = min(self.max_draft, len(response) - request.start - 1)
            self.proposals[key] = ngram_propose([*prompt, *response[:request.start]], cap, len(prompt)) if cap > 0 \
                else NO_PROPOSAL
        return self.proposals[key]

    def continuation(self, request: Request) -> list[int]:
        """What the response holds from the request's position on."""
        return self.pairs[request.prompt][1][request.start:]

    def estimates(self, request: Request) -> list[float]:
        """The head's â_k of the request's proposal."""
        key = (request.prompt, request.start)
        if key not in self.head_estimates:
            self.head_estimates[key] = list(self.head.estimates(self.proposal(request)))
        return self.head_estimates[key]


class Rule:
    """How many of each row's proposed tokens a round verifies (`lengths`), learning from the outcomes (`observe`)."""

    def __init__(self, responses: Responses) -> None:
        self.responses = responses

    def admit(self, row: int) -> None:
        """A new request takes `row`."""

    def lengths(self, rows: dict[int, Request], proposals: dict[int, Proposal], curve: CostCurve) -> dict[int, int]:
        """Each row's verify length this round."""
        raise NotImplementedError

    def observe(self, proposals: dict[int, Proposal], lengths: dict[int, int], accepted: dict[int, int]) -> None:
        """The round's proposals, verify lengths and accepted counts."""


class ConstantK(Rule):
    """Verify min(K, proposal) tokens (no planner)."""

    def __init__(self, responses: Responses, k: int) -> None:
        super().__init__(responses)
        self.k = k

    def lengths(self, rows: dict[int, Request], proposals: dict[int, Proposal], curve: CostCurve) -> dict[int, int]:
        return {row: min(self.k, len(proposal.tokens)) for row, proposal in proposals.items()}


class Planned(Rule):
    """The batch planner (`goodput_verify_lengths`) fed each row's survival products of its `estimates`."""

    def estimates(self, row: int, request: Request, proposal: Proposal) -> list[float]:
        """â_k of each of the row's proposed tokens (a prefix of them where the rest is not offered)."""
        raise NotImplementedError

    def lengths(self, rows: dict[int, Request], proposals: dict[int, Proposal], curve: CostCurve) -> dict[int, int]:
        survival = {row: survival_of(self.estimates(row, rows[row], proposals[row])) for row in rows}
        lengths, _ = goodput_verify_lengths(survival, curve)
        return {row: min(length, len(proposals[row].tokens)) for row, length in lengths.items()}


def survival_of(estimates: Sequence[float]) -> list[float]:
    """S_j = Π_{i≤j} â_i, each â clipped to [0, 1]."""
    return list(accumulate((min(max(estimate, 0.0), 1.0) for estimate in estimates), mul))


class HeadFed(Planned):
    """The token-only head's â_k."""

    def estimates(self, row: int, request: Request, proposal: Proposal) -> list[float]:
        return self.responses.estimates(request)


class OracleFed(Planned):
    """1 for each proposed token the response continues with; the tokens after them are not offered."""

    def estimates(self, row: int, request: Request, proposal: Proposal) -> list[float]:
        return [1.0] * accepted_prefix(proposal.tokens, self.responses.continuation(request))


class TableFed(Planned):
    """vLLM's online acceptance table (the decoder's `TablePlanner`), one for the whole batch."""

    def __init__(self, responses: Responses) -> None:
        super().__init__(responses)
        self.table = make_policy("lookup_table", 0.0, responses.max_draft).planner(None)

    def admit(self, row: int) -> None:
        self.table.admit(row)

    def estimates(self, row: int, request: Request, proposal: Proposal) -> list[float]:
        return self.table.estimates(row, proposal)

    def observe(self, proposals: dict[int, Proposal], lengths: dict[int, int], accepted: dict[int, int]) -> None:
        for row, proposal in proposals.items():
            self.table.plan(row, proposal, lengths[row])
        self.table.observe({row: [Outcome(j + 1, 1.0, j < accepted[row]) for j in range(min(accepted[row] + 1, length))]
                            for row, length in lengths.items()})


class TableWarming(TableFed):
    """Verifies every proposed token, so that its table counts each position up to the first rejection."""

    def lengths(self, rows: dict[int, Request], proposals: dict[int, Proposal], curve: CostCurve) -> dict[int, int]:
        return {row: len(proposal.tokens) for row, proposal in proposals.items()}


def warm_table(responses: Responses, warm: Responses, size: int, curve: CostCurve) -> TableFed:
    """vLLM's table fed by the rounds of one request of each of `warm`'s prompts served at B = `size`, then serving
    `responses` (its counts and step count kept, as a server's table runs on)."""
    warming = TableWarming(warm)
    serve(warm, warming, size, curve, queue_of(len(warm.pairs), size, 1))
    rule = TableFed(responses)
    rule.table = warming.table
    return rule


def make_rules(responses: Responses, constant_k: int, warm: TableFed | None = None) -> dict[str, Rule]:
    """A fresh instance of every rule (vLLM's table starts empty), and `warm`, a warmed table, where given."""
    return {TABLE: TableFed(responses), **({TABLE_WARM: warm} if warm is not None else {}), HEAD: HeadFed(responses),
            f"{CONSTANT_K}:{constant_k}": ConstantK(responses, constant_k), ORACLE: OracleFed(responses)}


@dataclass
class Served:
    """What a run served, per prompt of the labels: tokens emitted and the round prices' shares (seconds); in all:
    rounds, verified and accepted proposed tokens, row-rounds and finished requests."""

    tokens: np.ndarray
    seconds: np.ndarray
    rounds: int = 0
    verified: int = 0
    accepted: int = 0
    row_rounds: int = 0
    finished: int = 0

    def speedup(self, target_alone: float) -> float:
        """Throughput (tokens a second) over the target alone's."""
        return float(self.tokens.sum() / self.seconds.sum() / target_alone)


def queue_of(prompts: int, size: int, turnover: int) -> list[int]:
    """The requests' prompt indices in serving order: the prompts in turn, cycled, ceil(turnover · B / prompts) times."""
    return [index % prompts for index in range(prompts * math.ceil(turnover * size / prompts))]


def serve(responses: Responses, rule: Rule, size: int, curve: CostCurve, queue: Sequence[int]) -> Served:
    """Serve `queue` B = `size` rows at a time under `rule` (module docstring), until a row ends with no request left."""
    waiting = list(reversed(queue))
    if len(waiting) < size:
        raise UsageError(f"a queue of {len(waiting)} requests cannot fill B = {size} rows")
    rows = {row: Request(waiting.pop()) for row in range(size)}
    for row in rows:
        rule.admit(row)
    served = Served(np.zeros(len(responses.pairs)), np.zeros(len(responses.pairs)))
    while True:
        proposals = {row: responses.proposal(request) for row, request in rows.items()}
        lengths = rule.lengths(rows, proposals, curve)
        accepted = {row: accepted_prefix(proposals[row].tokens[:lengths[row]], responses.continuation(request))
                    for row, request in rows.items()}
        rule.observe(proposals, lengths, accepted)
        tokens = sum(lengths.values()) + size
        price = curve.price(tokens, size)
        served.rounds, served.row_rounds = served.rounds + 1, served.row_rounds + size
        served.verified += sum(lengths.values())
        served.accepted += sum(accepted.values())
        ended = False
        for row, request in rows.items():
            served.tokens[request.prompt] += accepted[row] + 1
            served.seconds[request.prompt] += price * (lengths[row] + 1) / tokens
            request.start += accepted[row] + 1
            if request.start >= len(responses.pairs[request.prompt][1]):
                served.finished += 1
                ended = ended or not waiting
                if waiting:
                    rows[row] = Request(waiting.pop())
                    rule.admit(row)
        if ended:
            return served


def target_alone(curve: CostCurve, size: int) -> float:
    """The target alone's throughput at B rows: B tokens a round, priced `price(B, B)`."""
    return size / curve.price(size, size)


def draws(prompts: int, resamples: int, seed: int = 0) -> np.ndarray:
    """[resamples, prompts]: how often each prompt is drawn in each bootstrap resample."""
    picks = np.random.default_rng(seed).integers(0, prompts, (resamples, prompts))
    weights = np.zeros((resamples, prompts))
    np.add.at(weights, (np.arange(resamples)[:, None], picks), 1.0)
    return weights


def figure(point: float, values: np.ndarray | None) -> dict[str, Any]:
    """A point estimate and its bootstrap 95 % interval (None without resamples)."""
    interval = None if values is None else [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]
    return {"value": point, "interval": interval}


def batch_figures(served: dict[str, Served], alone: float, weights: np.ndarray | None) -> dict[str, Any]:
    """Each rule's throughput over the target alone's and the head's over each table's, with paired intervals."""
    def resampled(run: Served) -> np.ndarray | None:
        return None if weights is None else (weights @ run.tokens) / (weights @ run.seconds) / alone

    rules = {name: {"speedup": figure(run.speedup(alone), resampled(run)),
                    "verified_per_row": run.verified / run.row_rounds, "accepted_per_row": run.accepted / run.row_rounds,
                    "tokens": int(run.tokens.sum()), "rounds": run.rounds}
             for name, run in served.items()}
    head = resampled(served[HEAD])
    ratios = {f"head_over_{name}": figure(served[HEAD].speedup(alone) / served[name].speedup(alone),
                                          None if head is None else head / resampled(served[name]))
              for name in (TABLE, TABLE_WARM) if name in served}
    return {"rules": rules, **ratios}


def cost_views(config: Config, context: int) -> dict[str, Callable[[int], CostCurve]]:
    """Each view's target curve at a batch size: the presets' at `context`, the CPU's measured one."""
    views: dict[str, Callable[[int], CostCurve]] = {
        name: (lambda size, preset=PRESETS[name]: roofline_costs(preset, context, size).target) for name in config.presets}
    if config.verify_curve:
        measured = read_curve(config.verify_curve)
        views[CPU_VIEW] = lambda size: measured
    return views


def load_pairs(labels: str) -> list[tuple[list[int], list[int]]]:
    """The labels' (prompt, greedy response) pairs, in their order."""
    from specheads.dataset.lookup import load_lookup

    rows = load_lookup(labels).select_columns(["prompt_ids", "target_ids"])
    return [(list(row["prompt_ids"]), list(row["target_ids"])) for row in rows]


def mean_context(pairs: Sequence[tuple[list[int], list[int]]]) -> int:
    """The mean context a round reads: the mean prompt plus half the mean response."""
    return round(float(np.mean([len(prompt) + len(response) / 2 for prompt, response in pairs])))


def run(config: Config, pairs: Sequence[tuple[list[int], list[int]]], head: Any,
        progress: Callable[[str], None] = lambda line: None,
        warm_pairs: Sequence[tuple[list[int], list[int]]] | None = None) -> dict[str, Any]:
    """Every rule at every B in every cost view (module docstring); with `warm_pairs`, a warmed table too."""
    responses = Responses(pairs, config.max_draft, head)
    warm = Responses(warm_pairs, config.max_draft) if warm_pairs else None
    context = config.context or mean_context(responses.pairs)
    views = cost_views(config, context)
    prompts = len(responses.pairs)
    weights = draws(prompts, config.resamples) if config.resamples else None
    results: dict[str, Any] = {}
    for view, curve_at in views.items():
        for size in config.batch_sizes:
            curve, queue = curve_at(size), queue_of(prompts, size, config.turnover)
            warmed = warm_table(responses, warm, size, curve) if warm else None
            served = {name: serve(responses, rule, size, curve, queue)
                      for name, rule in make_rules(responses, config.constant_k, warmed).items()}
            found = batch_figures(served, target_alone(curve, size), weights)
            results.setdefault(view, {})[str(size)] = found
            progress(summary_line(view, size, found))
    return {"labels": config.labels, "head": config.head, "warm_labels": config.warm_labels, "prompts": prompts,
            "context": context,
            "max_draft": config.max_draft, "turnover": config.turnover, "resamples": config.resamples,
            "verify_curve": None if not config.verify_curve else read_curve(config.verify_curve).as_dict(),
            "views": results}


def summary_line(view: str, size: int, found: dict[str, Any]) -> str:
    """One view and B: each rule's speedup over the target alone, and the head's over each table's."""
    def said(value: dict[str, Any]) -> str:
        low_high = value["interval"]
        return f"{value['value']:.3f}" + ("" if low_high is None else f" [{low_high[0]:.3f}, {low_high[1]:.3f}]")

    rules = ", ".join(f"{name} {said(value['speedup'])}x" for name, value in found["rules"].items())
    ratios = ", ".join(f"head/{key.removeprefix('head_over_')} {said(value)}" for key, value in found.items()
                       if key.startswith("head_over_"))
    return f"{view} B={size}: {rules}; {ratios}"


def main(argv: list[str] | None = None) -> int:
    config = parse_script(Config, "lookup_serving.py", __doc__.splitlines()[0], argv)
    try:
        from specheads.lookup.token_head import TokenHead

        head = TokenHead.load(config.head, "lookup")
        cost_views(config, 1)  # a bad --verify-curve is refused before anything is served
        pairs = load_pairs(config.labels)
        warm_pairs = load_pairs(config.warm_labels) if config.warm_labels else None
    except UsageError as error:
        raise SystemExit(f"lookup_serving.py: error: {error}") from None
    found = run(config, pairs, head, lambda line: print(line, flush=True), warm_pairs)
    if config.out:
        write_json_atomic(Path(config.out), found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
