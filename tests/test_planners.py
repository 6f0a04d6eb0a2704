"""The goodput planner and the field's free-signal planners in it (D-Cut's top-1 product, vLLM's adaptive
verification): the plan (plain decoding on a CPU-like curve, drafting on a flat one), each signal's choices by hand,
never slower than constant K or SmartSpec when its signal is calibrated, exactness at batch 10 with continuous
batching, and the distortion of the drawn-token variants the field ships."""

import math

import numpy as np
import pytest
import torch
from test_budget import output_distribution
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts, head_seconds, round_seconds
from specheads.decoding.online import Outcome
from specheads.decoding.planners import (
    GoodputPlanner,
    HeadSignal,
    SmartSpecPlanner,
    TopOneSignal,
    VllmSignal,
    plan_round,
    planned_goodput,
    threshold_verify_lengths,
)
from specheads.decoding.rules import BATCH_POLICIES, RULES, Drafted
from specheads.heads import ExpectedAcceptanceHead, OnTimeAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

CPU = ServingCosts(CostCurve((1, 2), (0.2, 0.4)), CostCurve((1, 2), (1.0, 2.0)))
"""A forward's time proportional to its tokens: checking a candidate costs what decoding a token does."""
GPU = ServingCosts(CostCurve((1, 256), (0.1, 0.12)), CostCurve((1, 256), (1.0, 1.1)))
"""Nearly flat until the forward is compute-bound: candidates are checked almost for free."""
MARGINAL = ServingCosts(CostCurve((1, 2), (0.1, 0.2)), CostCurve((1, 2), (1.0, 1.5)))
"""Each row adds 0.1 to a draft forward and each token 0.5 to the target's."""


def drafted(index: int, score: float, top1: float, prob: float = 0.5) -> Drafted:
    return Drafted(index=index, prob=prob, entropy=1.0, acceptance=1.0, score=score, top1=top1)


def test_the_plan_decodes_plainly_on_a_linear_curve_and_drafts_on_a_flat_one():
    """Counting the draft's forwards, no survival makes speculation pay where the target's time grows with its tokens
    (K = 0, plain decoding, at every B), while a flat target takes every candidate it may."""
    for rows in (1, 8, 32):
        # even candidates that are almost always accepted: plain decoding's token a row in t_target(B) = B, its draft's
        # catch-up (one more token a row in the draft's next forward, 0.2 B) deferred
        assert plan_round([0.99] * 4, rows, 4, CPU) == (0, pytest.approx(1 / 1.2))
        assert plan_round([0.7 ** j for j in range(1, 5)], rows, 4, GPU)[0] == 4
    for name in ("goodput", "dcut"):
        assert make_policy(name, 4).planner(CPU).round_cap(8, 4) == 0
        assert make_policy(name, 4).planner(GPU).round_cap(8, 4) == 4
    # vLLM verifies whole drafts until its estimator has been refitted three times, whatever the curve
    assert make_policy("vllm_adaptive", 4).planner(CPU).round_cap(8, 4) == 4


def test_the_plan_on_hand_computed_cases():
    """The round's goodput, the draft's time counted: B (1 + Σ checked S̄) / (K t_draft(B) + t_target(B + checked))."""
    # B = 1, t_draft = 0.5, t_target(n) = 4 + n, S̄ = (0.9, 0.45): K = 0: 1/5 = 0.2; K = 1: 1.9/6.5 = 0.292;
    # K = 2: 2.35/8 = 0.294 (checking only the first: 1.9/7 = 0.271)
    affine = ServingCosts(CostCurve((1, 2), (0.5, 0.5)), CostCurve((1, 2), (5.0, 6.0)))
    assert plan_round([0.9, 0.45], 1, 2, affine) == (2, pytest.approx(2.35 / 8))
    assert plan_round([0.9, 0.45], 1, 1, affine) == (1, pytest.approx(1.9 / 6.5))
    assert planned_goodput([0.9, 0.45], 1, 2, affine, verified=1) == pytest.approx(1.9 / 7)
    # B = 2 on a target flat to 3 tokens, then 2 a token: K = 1 checking one row's candidate, (2 + 0.9) / 1.1 = 2.64,
    # beats plain decoding (2), K = 1 checking both (3.8 / 3.1) and K = 2 (at best 2.9 / 1.2)
    stairs = ServingCosts(CostCurve((1, 2), (0.1, 0.1)), CostCurve((1, 3, 4), (1.0, 1.0, 3.0)))
    assert plan_round([0.9, 0.45], 2, 2, stairs) == (1, pytest.approx(2.9 / 1.1))


ROWS = {0: [drafted(1, score=0.9, top1=0.5, prob=0.2), drafted(2, score=0.5, top1=0.9)],
        1: [drafted(1, score=0.6, top1=0.95)]}


def test_one_planner_three_signals_each_ranks_by_its_own_survival_product():
    """At ρ = 1.1 on a target that adds 0.5 a token, a position is checked while its S ≥ 0.55, in order of S.
    head: S = (0.9, 0.45), (0.6); D-Cut: (0.5, 0.45), (0.95); vLLM (w = 1, b = (1, −1)): σ(logit 0.5 + 1) = 0.731,
    × σ(logit 0.9 − 1) = 0.768, = 0.561; σ(logit 0.95 + 1) = 0.981."""
    vllm = VllmSignal(positions=2)
    vllm.fit.theta, vllm.fit.refits = np.array([1.0, 1.0, -1.0]), 3
    expected = [(HeadSignal(), {0: [0.9, 0.45], 1: [0.6]}, {0: 1, 1: 1}),
                (TopOneSignal(), {0: [0.5, 0.45], 1: [0.95]}, {0: 0, 1: 1}),
                (vllm, {0: [0.7311, 0.5615], 1: [0.9810]}, {0: 2, 1: 1})]
    for signal, survival, lengths in expected:
        planner = GoodputPlanner(MARGINAL, signal)
        planner.rate = 1.1
        assert planner.verify_lengths(ROWS) == lengths, signal.name
        assert {row: pytest.approx(s, abs=1e-4) for row, s in survival.items()} == planner.round_survival()
    assert threshold_verify_lengths({0: [0.9, 0.45], 1: [0.6]}, 0.0, MARGINAL.target) == {0: 2, 1: 1}  # ρ = 0: free
    assert threshold_verify_lengths({0: [0.9, 0.45], 1: [0.6]}, 2.0, MARGINAL.target) == {0: 0, 1: 0}  # S ≥ 1 only
    not_ready = GoodputPlanner(MARGINAL, VllmSignal(positions=2))
    assert not_ready.verify_lengths(ROWS) == {0: 2, 1: 1} and not not_ready.stops(0, ROWS[1][0])


def test_a_row_drafts_on_while_its_next_candidate_pays_for_its_draft_and_target_time():
    """B = 2, K = 3, ρ = 1: one more candidate costs t_draft(2) − t_draft(1) = 0.1 and 0.5 of target time; its expected
    token is S_k times the row's last acceptance."""
    planner = GoodputPlanner(MARGINAL, HeadSignal())
    planner.k, planner.rows, planner.rate = 3, 2, 1.0
    assert not planner.stops(0, drafted(1, score=0.9, top1=1.0))  # 0.9 · 0.9 = 0.81 > 0.6
    assert planner.stops(0, drafted(2, score=0.7, top1=1.0))  # 0.63 · 0.7 = 0.44
    assert planner.stops(1, drafted(1, score=0.7, top1=1.0))  # 0.49
    assert not planner.stops(1, drafted(1, score=0.95, top1=1.0)) and not planner.stops(1, drafted(2, score=0.95, top1=1.0))
    assert planner.stops(1, drafted(3, score=1.0, top1=1.0))  # K reached
    planner.rate = 0.5  # a cheaper rate: the 0.63 row goes on (0.44 > 0.3)
    assert not planner.stops(0, drafted(1, score=0.9, top1=1.0)) and not planner.stops(0, drafted(2, score=0.7, top1=1.0))


def test_the_new_rules_are_registered_and_refuse_what_they_cannot_plan_with(tiny_pair):
    assert {"goodput", "dcut", "vllm_adaptive"} <= set(BATCH_POLICIES) & set(RULES)
    with pytest.raises(UsageError, match="largest K it may plan"):
        make_policy("dcut", 2.5)
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["q"], candidate_embedding_size=16)
    with pytest.raises(UsageError, match="expected_acceptance"):
        engine.decode([PROMPT], make_policy("goodput", 2), LENGTH, [0], on_time, costs=GPU)
    with pytest.raises(UsageError, match="acceptance head"):
        engine.decode([PROMPT], make_policy("goodput", 2), LENGTH, [0], costs=GPU)
    with pytest.raises(UsageError, match="cost curves"):
        engine.decode([PROMPT], make_policy("vllm_adaptive", 2), LENGTH, [0])


def serve(planner, constant: int | None, costs: ServingCosts, rows: int, rounds: int = 300, cap: int = 5) -> float:
    """Modelled tokens per second of `rounds` rounds of `rows` rows whose candidates' acceptance the signal knows
    (a context easy, middling or hard for the draft, jittered per position). Every policy meets the same contexts and
    the same uniform draws; `constant` K drafts and checks K candidates a row. A row's first draft forward reads the
    tokens its draft has not read (its catch-up: one more after each round of plain decoding, two after a round
    whose candidates all stood)."""
    rng = np.random.default_rng(0)
    tokens = seconds = 0.0
    unread = [1] * rows
    for _ in range(rounds):
        level = rng.choice([0.9, 0.5, 0.15], size=(rows, 1), p=[0.5, 0.3, 0.2])
        acceptance = np.clip(level + rng.normal(0.0, 0.05, (rows, cap)), 0.01, 0.99)
        draws = rng.random((rows, cap))
        k = constant if planner is None else planner.round_cap(rows, cap)
        seen: dict[int, list[Drafted]] = {}
        for row in range(rows):
            seen[row] = []
            for j in range(k):
                a = float(acceptance[row, j])
                seen[row].append(drafted(j + 1, score=a, top1=a))
                if j + 1 >= k or (planner is not None and planner.stops(row, seen[row][-1])):
                    break
        lengths = (planner.verify_lengths(seen) if planner is not None else None) or {r: len(s) for r, s in seen.items()}
        record, outcomes = RoundRecord(), {}
        for row in range(rows):
            accepted = 0
            while accepted < lengths[row] and draws[row, accepted] < acceptance[row, accepted]:
                accepted += 1
            outcomes[row] = [Outcome(j + 1, 0.5, j < accepted) for j in range(min(accepted + 1, lengths[row]))]
            record.requests.append(row)
            record.drafted.append(len(seen[row]))
            record.verified.append(lengths[row])
            record.emitted.append(accepted + 1)
            record.draft_widths.append([unread[row]] + [1] * (len(seen[row]) - 1) if seen[row] else [])
            unread[row] = unread[row] + 1 if not seen[row] else 2 if accepted == len(seen[row]) else 1
        if planner is not None:
            planner.observe(outcomes)
        tokens += sum(record.emitted)
        seconds += round_seconds(record, costs)
    return tokens / seconds


@pytest.mark.parametrize("view, rows", [("cpu", 8), ("cpu with overhead", 1), ("gpu", 1), ("gpu", 8), ("roofline", 32)])
def test_with_a_calibrated_signal_the_planner_serves_no_slower_than_constant_k_or_smartspec(view: str, rows: int):
    """In expectation under its own estimates the planner is never below the best constant K or SmartSpec's K: here
    its signal is the candidates' true acceptance, on a CPU-like curve (plain decoding wins), a CPU with a fixed
    overhead per forward, a flat accelerator and a roofline that turns compute-bound at 64 tokens."""
    costs = {"cpu": ServingCosts(CostCurve((1, 128), (0.2, 25.6)), CostCurve((1, 128), (1.0, 128.0))),
             "cpu with overhead": ServingCosts(CostCurve((1, 128), (0.1, 6.0)), CostCurve((1, 128), (1.0, 40.0))),
             "gpu": ServingCosts(CostCurve((1, 1024), (0.1, 0.15)), CostCurve((1, 1024), (1.0, 1.3))),
             "roofline": ServingCosts(CostCurve((1, 64, 512), (0.1, 0.1, 0.6)), CostCurve((1, 64, 512), (1.0, 1.0, 8.0)))
             }[view]
    planned = serve(GoodputPlanner(costs, HeadSignal(), max_k=5), None, costs, rows)
    constant = max(serve(None, k, costs, rows) for k in range(1, 6))
    smartspec = serve(SmartSpecPlanner(costs, max_k=5), None, costs, rows)
    assert planned >= 0.995 * max(constant, smartspec), (planned, constant, smartspec)
    if view == "cpu":  # plain decoding: one token per forward of the target
        assert planned == pytest.approx(rows / costs.target(rows)) and constant < 0.8 * planned


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


class Recorded(GoodputPlanner):
    """The planner, recording what it chose: K per round where it could draft, and each row's stop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.planned: list[int] = []
        self.stopped = 0

    def round_cap(self, rows: int, cap: int) -> int:
        k = super().round_cap(rows, cap)
        if cap > 0:
            self.planned.append(k)
        return k

    def stops(self, row: int, drafted: Drafted) -> bool:
        stop = super().stops(row, drafted)
        self.stopped += stop
        return stop


def test_the_goodput_planner_and_the_free_signal_planners_sample_the_target_distribution_at_batch_10(tiny_pair):
    """500 requests served 10 rows at a time with continuous batching: the goodput planner read by a random
    expected-acceptance head, D-Cut's top-1 product and vLLM's refitted estimate (warm after 5 rounds here), on cost
    curves that make them plan K = 2 and end rows' drafting early, check some drafted prefixes and drop the rest, or
    switch between plain decoding and drafting, leave every request's output the target's distribution."""
    target, draft = tiny_pair
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    head = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy", "top1"]).eval()
    torch.manual_seed(5)
    torch.nn.init.normal_(head.out.weight, std=2.0)
    torch.nn.init.constant_(head.out.bias, -5.5)  # survivals low enough that some rows stop drafting
    # each row adds 0.01 to a draft forward; the target is flat to 25 tokens (K = 2 for 10 rows), or to 15, then steep
    wide = ServingCosts(CostCurve((1, 8), (0.01, 0.08)), CostCurve((1, 25, 30), (1.0, 1.0, 4.0)))
    narrow = ServingCosts(CostCurve((1, 8), (0.01, 0.08)), CostCurve((1, 15, 20), (1.0, 1.0, 4.0)))
    # a costlier draft: K = 1 pays while the candidates' acceptance is above 0.6, which vLLM's estimate is not always
    switching = ServingCosts(CostCurve((1, 8), (0.31, 0.31)), CostCurve((1, 15, 20), (1.0, 1.0, 4.0)))
    runs = 500
    for name, costs, signal, expected in (("goodput", wide, HeadSignal(), {"K = 2", "early stops"}),
                                          ("goodput", narrow, HeadSignal(), {"dropped", "all checked"}),
                                          ("dcut", wide, TopOneSignal(), {"K = 2", "dropped", "all checked"}),
                                          ("vllm_adaptive", switching, VllmSignal(2, refit_every=5, warmup_refits=1),
                                           {"plain decoding", "dropped", "all checked"})):
        planner = Recorded(costs, signal, max_k=2)
        log: list[RoundRecord] = []
        results = engine.decode([PROMPT] * runs, make_policy(name, 2, max_draft=2), LENGTH, list(range(runs)), head,
                                batch_size=10, costs=costs, log=log, planner=planner)
        assert chi_square_p([tuple(r.tokens) for r in results], exact) > 1e-3, name
        assert max(len(r.requests) for r in log) == 10 and sum(sum(r.emitted) for r in log) == runs * LENGTH
        pairs = [(v, d) for r in log for v, d in zip(r.verified, r.drafted)]
        seen = {"K = 2": 2 in planner.planned, "early stops": planner.stopped > 0, "plain decoding": 0 in planner.planned,
                "dropped": any(v < d for v, d in pairs), "all checked": any(v == d > 0 for v, d in pairs)}
        assert expected <= {what for what, happened in seen.items() if happened}, (name, seen)


P, Q = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]
"""The target's and the draft's distributions of the distortion tests (tests/test_budget.py's)."""


def checked_at_half(survival: float) -> bool:
    """The planner's verify step at ρ = 1 on a target adding 0.5 a token: checked when S ≥ 0.5."""
    return threshold_verify_lengths({0: [survival]}, 1.0, MARGINAL.target)[0] == 1


def total_variation(a: list[float], b: list[float]) -> float:
    return 0.5 * sum(abs(x - y) for x, y in zip(a, b))


def test_d_cut_read_from_the_drawn_token_distorts_the_output_and_from_the_top1_does_not():
    """D-Cut ranks by the probability of the token its drafter selected: max q_k for DFlash's greedy drafts, known
    before the draw, and exact; q(ŷ_k) once drafts are sampled (vLLM PR #44885's serial path), which checks the
    draft's most confident tokens and lets the target decode the rest: (0.7, 0.15, 0.15), total variation 0.15."""
    assert output_distribution(P, Q, lambda drawn: max(Q), checked_at_half) == pytest.approx(P, abs=1e-12)
    lossy = output_distribution(P, Q, lambda drawn: Q[drawn], checked_at_half)
    assert lossy == pytest.approx([0.7, 0.15, 0.15], abs=1e-12) and total_variation(lossy, P) == pytest.approx(0.15)


def test_vllms_estimate_read_from_the_drawn_token_distorts_the_output_and_from_the_top1_does_not():
    """vLLM's newest estimator (`acceptance_estimator.py`: σ(w · logit(q(ŷ_k)) + b_k)) reads the drawn token; with
    w = 1, b = 1 it checks ŷ when q(ŷ) ≥ 0.27, so tokens 1 and 2: (0.52, 0.36, 0.12), total variation 0.08. On
    logit(max q_k) (PR #52228's feature, what `vllm_adaptive` reads) the same estimate is exact."""
    signal = VllmSignal(positions=1)
    signal.fit.theta = np.array([1.0, 1.0])
    exact = output_distribution(P, Q, lambda drawn: signal.acceptance(drafted(1, score=1.0, top1=max(Q), prob=Q[drawn])),
                                checked_at_half)
    assert exact == pytest.approx(P, abs=1e-12)
    drawn_feature = output_distribution(P, Q, lambda drawn: signal.fit.probability(drafted(1, 1.0, 1.0, prob=Q[drawn])),
                                        checked_at_half)
    assert drawn_feature == pytest.approx([0.52, 0.36, 0.12], abs=1e-12)
    assert total_variation(drawn_feature, P) == pytest.approx(0.08) and math.isclose(signal.fit.theta[0], 1.0)


def test_the_plan_prices_the_heads_forwards_as_round_seconds_does_and_a_dear_head_plans_smaller_k():
    """A round of K candidates a row, each scored by the head: the plan's seconds are the served round's, the head's K
    forwards over the B rows at h × the draft's curve or on the head's own curve, and nothing for a free signal (no
    head: h None, whatever curve the costs carry). A dearer head plans a smaller K: 4 → 3 at B = 1 already at the
    shipped head's h = 0.0315, 4 → 2 at h = 1."""
    draft, target, curve = CostCurve((1, 8), (1.0, 1.7)), CostCurve((1, 8), (5.0, 6.4)), CostCurve((1, 8), (0.3, 0.37))
    survival, rows, k, h = [0.8 ** j for j in range(1, 6)], 4, 3, 0.05
    record = RoundRecord(requests=list(range(rows)), drafted=[k] * rows, verified=[k] * rows, emitted=[0] * rows,
                         head_widths=[[1] * k] * rows, head_cost=h)
    for costs in (ServingCosts(draft, target), ServingCosts(draft, target, curve)):
        def seconds(head_cost: float | None, costs: ServingCosts = costs) -> float:
            return rows * (1 + sum(survival[:k])) / planned_goodput(survival, rows, k, costs, head_cost=head_cost)

        assert seconds(h) - seconds(None) == pytest.approx(head_seconds(record, costs)) and head_seconds(record, costs) > 0
        assert plan_round(survival, 1, 5, costs, None) == plan_round(survival, 1, 5, ServingCosts(draft, target))
    flat = ServingCosts(draft, target)
    assert [plan_round(survival, 1, 5, flat, h)[0] for h in (0.0, 0.0315, 1.0)] == [4, 3, 2]
    planner = make_policy("goodput", 5).planner(flat)
    planner.expected = list(survival)
    assert planner.round_cap(1, 5) == 4
    planner.price_head(1.0)
    assert planner.round_cap(1, 5) == 2
    assert not planner.worth_drafting(0.7, 1, 0.7)  # a second candidate at 0.49 pays for h = 0, not for h = 1
    planner.price_head(0.0)
    planner.round_cap(1, 5)
    assert planner.worth_drafting(0.7, 1, 0.7)
