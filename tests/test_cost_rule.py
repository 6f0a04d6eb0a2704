"""The stop rule read from the costs (`specheads.decoding.cost_rule`): the optimum of a synthetic acceptance process
found by enumeration, the rate it learns at run time, and exactness through the round engine."""

import itertools
import json
import random

import pytest
import torch
from test_budget import ended_rounds
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.cost_rule import CostPlanner, verify_cost, verify_step, worth_drafting
from specheads.decoding.costs import CostCurve
from specheads.decoding.online import Outcome
from specheads.decoding.rules import Drafted
from specheads.heads import OnTimeAcceptanceHead, ResNetAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

CURVES = {"flat": None, "linear": CostCurve((1, 2), (1.0, 1.15)),
          "flat, then compute-bound (an accelerator)": CostCurve((1, 4, 8, 16), (1.0, 1.0, 1.4, 2.2))}


def enumerated_optimum(acceptance: list[float], cost_ratio: float, curve: CostCurve | None) -> tuple[int, float]:
    """The round length k maximising (1 + Σ_{j≤k} S_j) / (c·k + t(k + 1) / t(1)), by trying every k: the long-run
    rate of a decoder whose every round has these per-position acceptances (k = 0: plain decoding)."""
    one = 1.0 if curve is None else curve(1)
    rates = []
    for k in range(len(acceptance) + 1):
        survival = [1.0]
        for a in acceptance[:k]:
            survival.append(survival[-1] * a)
        target = 1.0 if curve is None else curve(k + 1) / one
        rates.append((1.0 + sum(survival[1:])) / (cost_ratio * k + target))
    best = max(range(len(rates)), key=rates.__getitem__)
    return best, rates[best]


def rule_length(acceptance: list[float], cost_ratio: float, curve: CostCurve | None, rate: float) -> int:
    """Where the rule ends a round whose k-th candidate has survival Π_{j≤k} a_j and whose next is accepted with
    a_{k+1}, at the rate `rate`; it drafts the first candidate whenever the second could pay (a round drafts >= 1)."""
    survival = 1.0
    for k, a in enumerate(acceptance, start=1):
        survival *= a
        if k == len(acceptance) or not worth_drafting(survival, acceptance[k], rate, cost_ratio, verify_step(curve, k)):
            return k
    return len(acceptance)


@pytest.mark.parametrize("curve_name", list(CURVES))
def test_the_rule_at_the_optimal_rate_stops_where_enumeration_finds_the_best_round(curve_name):
    """Per-position acceptances falling along the round (a survival curve known in advance), c in {0.05, 0.2, 0.5}
    and three verify curves: the rule, fed the optimum's rate ρ*, ends every round at the enumerated best k."""
    curve = CURVES[curve_name]
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        acceptance = sorted((rng.uniform(0.05, 0.99) for _ in range(8)), reverse=True)
        for cost_ratio in (0.05, 0.2, 0.5):
            best, rate = enumerated_optimum(acceptance, cost_ratio, curve)
            if best == 0:  # not speculating pays: the rule's first candidate is already drafted, nothing to compare
                continue
            assert rule_length(acceptance, cost_ratio, curve, rate) == best, (acceptance, cost_ratio)
            checked += 1
    assert checked > 600


def test_the_rule_at_the_rate_of_target_only_decoding_drafts_too_long():
    """Without the rate (the first-order reading S·μ > c) the rule overshoots the optimum: ρ* matters."""
    acceptance = [0.9] * 12
    best, rate = enumerated_optimum(acceptance, 0.2, None)
    assert rate > 1.5 and rule_length(acceptance, 0.2, None, 1.0) > best == rule_length(acceptance, 0.2, None, rate)


def test_the_verify_curve_enters_as_the_cost_of_one_more_checked_token():
    linear = CURVES["linear"]
    assert verify_step(None, 3) == 0.0 and verify_cost(None, 5) == 1.0
    assert verify_step(linear, 3) == pytest.approx(0.15) and verify_cost(linear, 2) == pytest.approx(1.3)
    accelerator = CURVES["flat, then compute-bound (an accelerator)"]
    assert verify_step(accelerator, 1) == 0.0 and verify_step(accelerator, 8) == pytest.approx(0.1)


def simulate(planner: CostPlanner, acceptance: float, rounds: int, cap: int, seed: int) -> list[int]:
    """One request of a process whose every candidate is accepted with `acceptance`, scored by a calibrated head
    (â = acceptance): the planner decides each round's length and observes its outcomes; the lengths it chose."""
    rng = random.Random(seed)
    planner.admit(0)
    lengths = []
    for _ in range(rounds):
        survival = 1.0
        for index in itertools.count(1):
            survival *= acceptance
            seen = Drafted(index=index, prob=0.5, entropy=1.0, acceptance=survival, score=acceptance)
            if index >= cap or planner.stops(0, seen):
                break
        outcomes = []
        for position in range(1, index + 1):
            accepted = rng.random() < acceptance
            outcomes.append(Outcome(position, 0.5, accepted))
            if not accepted:
                break
        planner.observe({0: outcomes})
        lengths.append(index)
    return lengths


@pytest.mark.parametrize(("acceptance", "cost_ratio"), [(0.8, 0.2), (0.6, 0.05), (0.9, 0.5), (0.7, 0.2)])
def test_the_rate_learnt_at_run_time_converges_to_the_optimum(acceptance, cost_ratio):
    """Dinkelbach's iteration run on the request's own outcomes: after a few hundred rounds the rule's rounds have
    the enumerated best length, its rate estimate is the optimum's, and so is the rate it realised."""
    cap = 10
    best, optimum = enumerated_optimum([acceptance] * cap, cost_ratio, None)
    planner = CostPlanner(cost_ratio)
    lengths = simulate(planner, acceptance, 3000, cap, seed=3)
    state = planner.requests[0]
    assert state.rate() == pytest.approx(optimum, rel=0.05)
    assert sum(length == best for length in lengths[-1000:]) > 900, (best, lengths[-20:])


def test_a_candidate_the_head_scores_costs_c_times_one_plus_h_in_the_stop_and_in_the_rate():
    """The head's forward over each candidate (h draft forwards) joins the draft's: the rule learns the optimum of a
    draft c·(1 + h) as costly, drafting fewer candidates, and its rate charges each candidate c·(1 + h)."""
    acceptance, cost_ratio, head_cost, cap = 0.8, 0.2, 1.0, 10
    best, optimum = enumerated_optimum([acceptance] * cap, cost_ratio * (1 + head_cost), None)
    assert best < enumerated_optimum([acceptance] * cap, cost_ratio, None)[0]
    planner = CostPlanner(cost_ratio)
    planner.price_head(head_cost)
    lengths = simulate(planner, acceptance, 3000, cap, seed=3)
    assert planner.requests[0].rate() == pytest.approx(optimum, rel=0.05)
    assert sum(length == best for length in lengths[-1000:]) > 900, (best, lengths[-20:])
    planner.admit(0)
    assert not planner.stops(0, Drafted(index=1, prob=0.9, entropy=0.1, acceptance=0.99, score=0.99))
    planner.observe({0: [Outcome(1, 0.9, True), Outcome(2, 0.9, False)]})
    assert planner.requests[0].cost == pytest.approx(cost_ratio * (1 + head_cost) * 2 + 1)


def test_a_round_the_cap_ends_is_counted_at_its_drafted_length():
    """The cap ends a round after the planner has seen its last candidate (and let it pass): the cost it records is
    that of the candidates drafted, not one more."""
    planner = CostPlanner(0.25)
    planner.admit(0)
    for index in (1, 2, 3):
        assert not planner.stops(0, Drafted(index=index, prob=0.9, entropy=0.1, acceptance=0.99, score=0.99))
    planner.observe({0: [Outcome(1, 0.9, True), Outcome(2, 0.9, True), Outcome(3, 0.9, False)]})
    state = planner.requests[0]
    assert state.tokens == 3 and state.cost == pytest.approx(0.25 * 3 + 1)
    planner.admit(0)  # a new request starts from target-only decoding's rate
    assert planner.requests[0].rate() == 1.0


def test_the_cost_rule_needs_a_head_that_scores_each_candidate_when_drafted(tiny_pair):
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="needs an acceptance head"):
        engine.decode([PROMPT], make_policy("head_cost", 0.2, max_draft=3), LENGTH, [0])
    lagged = ResNetAcceptanceHead(16, depth=1)
    with pytest.raises(UsageError, match="one_step_late"):
        engine.decode([PROMPT], make_policy("head_cost", 0.2, max_draft=3), LENGTH, [0], lagged)
    with pytest.raises(UsageError, match="cost ratio"):
        make_policy("head_cost", 1.5)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


def test_the_planner_sees_the_score_of_the_candidate_the_cap_ends_a_round_on(tiny_pair):
    """At c = 0.001 the rule drafts to the cap of 2: every drafted candidate, the capped one too, reaches the
    planner (its mean acceptance reads the deepest scores), and each round is charged its drafted candidates."""
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    rule = make_policy("head_cost", 0.001, max_draft=2)
    planner = rule.planner(None)
    result = engine.decode([PROMPT], rule, 12, [0], head, planner=planner)[0]
    state = planner.requests[0]
    assert 2 in result.drafted_per_round and state.scored == result.drafted
    charge = 0.001 * (1 + planner.head_cost)
    assert state.cost == pytest.approx(sum(charge * drafted + 1 for drafted in result.drafted_per_round))


def test_the_cost_rule_samples_the_target_distribution_at_batch_10(tiny_pair):
    """500 requests, 10 rows at a time with continuous batching, an on-time head with scores that vary with the
    state, on a flat and on a linear verify curve: every request's output is the target's distribution, and the
    rule ended some rounds early and let others run to the cap."""
    from specheads.decoding.costs import ServingCosts

    target, draft = tiny_pair
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(head.out.weight, std=2.0)
    linear = ServingCosts(CostCurve((1, 2), (0.1, 0.2)), CostCurve((1, 2), (1.0, 1.3)))
    runs = 500
    rule = make_policy("head_cost", 0.1, max_draft=3)
    for costs in (None, linear):
        results = engine.decode([PROMPT] * runs, rule, LENGTH, list(range(runs)), head, batch_size=10, costs=costs)
        assert chi_square_p([tuple(r.tokens) for r in results], exact) > 1e-3, costs
        assert ended_rounds(results, rule) == {"early", "at the cap"}, costs


def calibrated_on_time_head() -> OnTimeAcceptanceHead:
    from specheads.heads.calibration import PositionCalibration

    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(head.out.weight, std=2.0)
    head.set_calibration(PositionCalibration((1.0, 1.0, 1.0), (0.0, 0.0, 0.0)))
    return head


def report_with(ece_by_position: list[float]):
    """What export reads of an eval report: its tuned stop rule, config and calibrated cumulative rows."""
    from types import SimpleNamespace

    from specheads.heads.loading import STOP_RULE, DecisionRule

    rows = [{"k": k, "stage": stage, "ece": ece if stage == "calibrated" else 0.3}
            for k, ece in enumerate(ece_by_position, start=1) for stage in ("raw", "calibrated")]
    return SimpleNamespace(decision_rule=DecisionRule(STOP_RULE, 0.6, tuned=True, max_draft=3, cost_ratio=0.2),
                           config={"max_draft": 3, "cost_ratio": 0.2}, cumulative=rows)


def test_export_gives_the_cost_rule_only_to_a_head_whose_calibration_allows_it():
    """Calibrated ECE within 0.05 at every position up to max_draft: the cost rule at the report's c, tuned nowhere;
    one position beyond it, no calibration, or a lagged head: the tuned threshold, with the reason recorded."""
    from types import SimpleNamespace

    from specheads.export.run import default_rule
    from specheads.heads.loading import COST_RULE, STOP_RULE

    head = calibrated_on_time_head()
    rule, choice = default_rule(SimpleNamespace(head=head), report_with([0.01, 0.03, 0.04]))
    assert (rule.rule, rule.threshold, rule.tuned, rule.max_draft) == (COST_RULE, 0.2, False, 3)
    assert choice["rule"] == COST_RULE and choice["tuned_threshold"] == 0.6 and "0.040" in choice["why"]
    rule, choice = default_rule(SimpleNamespace(head=head), report_with([0.01, 0.08, 0.04]))
    assert rule.rule == STOP_RULE and rule.threshold == 0.6 and "position 2" in choice["why"]
    head.set_calibration(None)
    rule, choice = default_rule(SimpleNamespace(head=head), report_with([0.01, 0.01, 0.01]))
    assert rule.rule == STOP_RULE and "not calibrated" in choice["why"]
    rule, choice = default_rule(SimpleNamespace(head=ResNetAcceptanceHead(16, depth=1)), report_with([0.01] * 3))
    assert rule.rule == STOP_RULE and "one_step_late" in choice["why"]


def test_generate_runs_the_cost_rule_a_head_carries_and_takes_the_callers_cost_ratio(tmp_path):
    """A head exported with the cost rule loads with it; through generate it decodes the target's greedy tokens, the
    caller's cost ratio changes how far it drafts, and a head with a tuned threshold refuses a cost ratio."""
    from test_integration_transformers import near_pair

    from specheads.heads import load_head
    from specheads.heads.loading import COST_RULE, STOP_RULE, DecisionRule
    from specheads.integrations.transformers import speculative_generate

    target, draft = near_pair()  # a draft near the target: rounds keep several tokens
    calibrated_on_time_head().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["decision_rule"] = DecisionRule(COST_RULE, 0.2, tuned=False, max_draft=6, cost_ratio=0.2).as_dict()
    config["sampling"] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}  # greedy, as export records it
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_head(str(tmp_path))
    assert loaded[1].rule == COST_RULE
    ids = torch.tensor([[5, 9, 1]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    drafted = {}
    for cost_ratio in (None, 0.02, 0.9):
        stats = []
        ours = target.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=speculative_generate,
                               draft=draft, head=loaded, stats=stats, cost_ratio=cost_ratio)
        assert ours.tolist() == plain.tolist()
        drafted[cost_ratio] = stats[0].drafted / stats[0].target_calls
    assert drafted[0.02] > drafted[0.9]  # cheaper drafting, longer rounds
    tuned = (loaded[0], DecisionRule(STOP_RULE, 0.5, tuned=True, max_draft=3, cost_ratio=0.2))
    with pytest.raises(UsageError, match="drop cost_ratio"):
        target.generate(ids, do_sample=False, max_new_tokens=5, custom_generate=speculative_generate, draft=draft,
                        head=tuned, cost_ratio=0.1)


def test_a_head_folder_carrying_the_cost_rule_keeps_it_when_exported_again(tmp_path):
    """The rule is tuned nowhere, so `tuned` is false: re-exporting the folder must not take it for an untuned
    default and drop it."""
    from specheads.artifacts.checkpoint import load_trained
    from specheads.heads.loading import COST_RULE, DecisionRule

    calibrated_on_time_head().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rule = DecisionRule(COST_RULE, 0.2, tuned=False, max_draft=6, cost_ratio=0.2)
    config["decision_rule"] = rule.as_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_trained(str(tmp_path)).rule == rule
