"""Estimates refitted while serving (issue 62): vLLM's merged online estimator and its margin revision, a per-request
history, llama.cpp's p_min and a head calibrated online. Their fits read past outcomes only, of positions the target
checked; they follow a change of traffic; and every rule and planner built on them samples the target's distribution."""

import math

import numpy as np
import pytest
import torch
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.decoding import RoundEngine, candidate_signals, make_policy
from specheads.decoding.calibration import (
    CalibratedCostPlanner,
    EstimatorSignal,
    HistorySignal,
    OnlineLogistic,
    PMinPlanner,
    SignalStop,
    head_signal,
    margin_signal,
    vllm_signal,
)
from specheads.decoding.costs import CostCurve, RoundRecord, ServingCosts
from specheads.decoding.online import Outcome, drawn_logit
from specheads.decoding.planners import GoodputPlanner
from specheads.decoding.rules import Drafted
from specheads.heads import ExpectedAcceptanceHead, OnTimeAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


def drafted(index: int, top1: float = 0.5, score: float = 1.0, margin: float = 0.0) -> Drafted:
    return Drafted(index=index, prob=0.5, entropy=1.0, acceptance=1.0, score=score, top1=top1, margin=margin)


def logistic_rounds(seed: int, count: int, rows: int = 4, slope: float = 1.5, intercepts=(0.5, 0.0, -0.5),
                    shift: float = 0.0):
    """`count` rounds of `rows` rows drafting 3 candidates whose acceptance is σ(slope · logit(max q) + b_k + shift),
    each row's outcomes ended at its first rejection: (drafts per row, outcomes per row) per round."""
    rng = np.random.default_rng(seed)
    stream = []
    for _ in range(count):
        rounds, outcomes = {}, {}
        for row in range(rows):
            rounds[row] = [drafted(k, float(rng.uniform(0.02, 0.98))) for k in (1, 2, 3)]
            outcomes[row] = []
            for seen in rounds[row]:
                chance = 1 / (1 + math.exp(-(slope * drawn_logit(seen.top1) + intercepts[seen.index - 1] + shift)))
                outcomes[row].append(Outcome(seen.index, 0.5, bool(rng.uniform() < chance)))
                if not outcomes[row][-1].accepted:
                    break
        stream.append((rounds, outcomes))
    return stream


def test_the_merged_estimator_starts_at_vllms_cold_fit_and_trims_from_the_first_round():
    """vLLM's merged estimator: σ(0.5 · logit(max q) − 0.2) before any outcome, and no warm-up (its 300-step warm-up
    was removed before merge); the margin revision starts uniform at σ(1.5) and drafts full blocks until its third
    refit (100 rounds each)."""
    current = vllm_signal(3)
    assert current.ready and current.acceptance(drafted(2, top1=0.8)) == pytest.approx(
        1 / (1 + math.exp(-(0.5 * math.log(4) - 0.2))))
    stop = SignalStop(vllm_signal(3), 0.5)
    assert stop.stops(0, drafted(1, top1=0.05))  # σ(0.5 · logit 0.05 − 0.2) = 0.17: 1 − 0.17 > 0.5 at once
    margin = margin_signal(3)
    assert margin.acceptance(drafted(1, margin=7.0)) == pytest.approx(1 / (1 + math.exp(-1.5)))
    planner = SignalStop(margin, 0.0)
    for step, (rounds, outcomes) in enumerate(logistic_rounds(0, 301)):
        assert planner.stops(0, drafted(1, margin=0.0)) == (step >= 300), step  # full blocks for 3 refits
        planner.verify_lengths(rounds)
        planner.observe(outcomes)
    assert margin.fit.refits == 3


def test_a_refit_is_the_joint_newton_step_with_the_intercepts_profiled_out():
    """With no damping the profiled step (vLLM's arrowhead formula) is the full Newton step of the ridge-penalised
    log-likelihood, solved here as one linear system; with vLLM's damping the slope's step shrinks by n / (n + 50)
    over the window, each intercept's by its own count, a position nobody reached holds still, a step that would make
    the slope negative is dropped, and every refit starts a new window."""
    rng = np.random.default_rng(1)
    features = rng.normal(size=80)
    samples = [(float(f), int(rng.integers(1, 3)), bool(rng.uniform() < 1 / (1 + math.exp(-2.0 * f)))) for f in features]

    def folded(damping: float, slope: float = 0.5) -> OnlineLogistic:
        fit = OnlineLogistic(3, (slope,), -0.2, refit_every=1000, damping=damping)
        fit.fold([[f] for f, _, _ in samples], [k for _, k, _ in samples], [y for _, _, y in samples])
        return fit

    fit = folded(0.0)
    design = np.zeros((len(samples), 4))
    design[:, 0] = [f for f, _, _ in samples]
    design[np.arange(len(samples)), [k for _, k, _ in samples]] = 1.0
    theta = np.array([0.5, -0.2, -0.2, -0.2])
    p = 1 / (1 + np.exp(-(design @ theta)))
    labels = np.array([float(y) for _, _, y in samples])
    newton = np.linalg.solve((design * (p * (1 - p))[:, None]).T @ design + 1e-3 * np.eye(4), design.T @ (labels - p))
    fit.refit()
    assert fit.slopes[0] == pytest.approx(0.5 + newton[0], abs=1e-9)
    assert fit.intercepts[:2] == pytest.approx(-0.2 + newton[1:3], abs=1e-9)
    assert fit.intercepts[2] == -0.2 and fit.refits == 1 and fit.counts.sum() == 0  # position 3: never reached
    damped, undamped = folded(50.0), folded(0.0)
    counts = damped.counts.copy()
    slope_step = newton[0] * 80 / 130
    damped.refit()
    assert damped.slopes[0] == pytest.approx(0.5 + slope_step, abs=1e-9)
    intercept_steps = (undamped.residual - undamped.coupling[:, 0] * slope_step) / (undamped.weight + 1e-3)
    assert damped.intercepts[:2] == pytest.approx(-0.2 + (intercept_steps * counts / (counts + 50))[:2], abs=1e-9)
    falling = OnlineLogistic(1, (0.1,), 0.0, damping=0.0)
    features = np.linspace(-3, 3, 60)  # acceptance falls as the feature rises: the slope would turn negative
    falling.fold(features[:, None], [1] * 60, features < 0)
    falling.refit()
    assert falling.slopes[0] == 0.1


def test_the_fit_recovers_a_logistic_and_reads_past_outcomes_only():
    """Fed rounds whose acceptance is σ(1.5 · logit(max q) + b_k), the merged estimator finds the slope and the order of
    the intercepts; two streams that share their first 250 rounds hold the same coefficients up to there."""
    signal = vllm_signal(3)
    for rounds, outcomes in logistic_rounds(2, 1500):
        signal.observe(rounds, outcomes)
    assert signal.fit.refits == 15 and signal.fit.slopes[0] == pytest.approx(1.5, abs=0.25)
    assert signal.fit.intercepts[0] > signal.fit.intercepts[2]
    shared, late_a, late_b = logistic_rounds(3, 250), logistic_rounds(4, 60), logistic_rounds(5, 60)
    first, second = vllm_signal(3), vllm_signal(3)
    for (rounds, outcomes), late in zip(shared + late_a, shared + late_b):
        first.observe(rounds, outcomes)
        second.observe(*late)
        if second.fit.steps == 250:
            assert np.array_equal(first.fit.slopes, second.fit.slopes)
            assert np.array_equal(first.fit.intercepts, second.fit.intercepts)
    assert not np.array_equal(first.fit.intercepts, second.fit.intercepts)  # the refit at 300 read the late rounds


def test_a_stop_rule_learns_from_the_positions_the_target_checked_only():
    """A row's drafts are recorded when the engine hands the round to the planner; the fit folds those the target
    checked up to the first rejection (a position past it, or past a row's stop, is never labelled), with the
    features of the candidate at that position."""
    signal = vllm_signal(3)
    planner = SignalStop(signal, 0.5)
    rounds = {0: [drafted(1, 0.9), drafted(2, 0.3), drafted(3, 0.7)], 1: [drafted(1, 0.6)], 2: []}
    assert planner.verify_lengths(rounds) is None  # a stop rule checks every candidate it drafted
    planner.observe({0: [Outcome(1, 0.5, True), Outcome(2, 0.5, False)], 1: [Outcome(1, 0.5, True)], 2: []})
    assert signal.fit.counts.tolist() == [2, 1, 0] and signal.fit.steps == 1
    assert signal.fit.slope_score[0] == pytest.approx(
        sum((y - signal.acceptance(d)) * drawn_logit(d.top1)
            for d, y in ((rounds[0][0], 1), (rounds[0][1], 0), (rounds[1][0], 1))))


def test_audited_rounds_draft_full_width_so_trimmed_positions_are_still_observed():
    """With `audit_every` 3 the head's calibration drafts every third round to the cap (the rule does not stop it),
    and the candidates the rule would have cut are then checked and learnt from."""
    signal = head_signal(3, audit_every=3)
    planner = SignalStop(signal, 0.1)
    stops = []
    for _ in range(6):
        stops.append(planner.stops(0, drafted(1, score=0.5)))
        drafts = 1 if stops[-1] else 3  # a stopped round drafted one candidate; an audited one all three
        planner.verify_lengths({0: [drafted(k, score=0.5) for k in range(1, drafts + 1)]})
        planner.observe({0: [Outcome(k, 0.5, k < 3) for k in range(1, drafts + 1)]})
    assert stops == [False, True, True, False, True, True] and signal.fit.counts.tolist() == [6, 2, 2]


def test_the_history_source_counts_each_requests_reached_and_verified_positions():
    """a_j = (accepted at j + 0.7 · 2) / (checked at j + 2) over the request's earlier rounds; a new request starts from
    0.7 again, another row keeps its own."""
    history = HistorySignal(3)
    history.admit(0)
    history.admit(1)
    assert history.acceptance_at(0, drafted(1)) == pytest.approx(0.7)
    history.observe({}, {0: [Outcome(1, 0.5, True), Outcome(2, 0.5, False)], 1: [Outcome(1, 0.5, False)]})
    history.observe({}, {0: [Outcome(1, 0.5, True), Outcome(2, 0.5, True), Outcome(3, 0.5, False)]})
    assert history.acceptance_at(0, drafted(1)) == pytest.approx((2 + 1.4) / (2 + 2))
    assert history.acceptance_at(0, drafted(2)) == pytest.approx((1 + 1.4) / (2 + 2))
    assert history.acceptance_at(0, drafted(5)) == pytest.approx((0 + 1.4) / (1 + 2))  # past the cap: the last position
    assert history.acceptance_at(1, drafted(1)) == pytest.approx(1.4 / 3)
    history.admit(0)
    assert history.acceptance_at(0, drafted(1)) == pytest.approx(0.7)
    rule = make_policy("vllm_history", 0.5, max_draft=3).planner(None)
    rule.admit(0)
    assert not rule.stops(0, drafted(1)) and rule.stops(0, drafted(2))  # 1 − 0.49 > 0.5 at the second candidate


def test_pmin_ends_the_round_at_a_low_top1_and_leaves_that_candidate_unchecked(tiny_pair):
    """llama.cpp's p_min: drafting ends at the first candidate whose max q is below p_min, and that candidate is
    dropped (its draft forward spent); one ended by the cap is checked."""
    rule = make_policy("pmin", 0.6, max_draft=3)
    assert rule.stop(drafted(1, top1=0.5)) and not rule.stop(drafted(1, top1=0.7))
    planner = PMinPlanner(0.6)
    assert planner.verify_lengths({0: [drafted(1, 0.9), drafted(2, 0.4)], 1: [drafted(1, 0.9)] * 3, 2: []}) == \
        {0: 1, 1: 3, 2: 0}
    target, draft = tiny_pair
    log: list[RoundRecord] = []
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    engine.decode([PROMPT] * 20, make_policy("pmin", 0.7, max_draft=3), 6, list(range(20)), batch_size=5, log=log)
    pairs = [(v, d) for r in log for v, d in zip(r.verified, r.drafted)]
    assert any(v == d - 1 for v, d in pairs) and all(v in (d - 1, d) for v, d in pairs)


def test_the_margin_is_the_gap_of_the_two_largest_log_probabilities():
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0])
    transform = SamplingTransform(1.0)
    signals = candidate_signals(logits, transform.log_probs(logits), 2, transform)
    assert signals["margin"] == pytest.approx(1.0, abs=1e-6) and signals["top1"] == pytest.approx(
        float(logits.softmax(-1).max()))
    greedy = SamplingTransform(1.0, top_k=1)  # one token left: the margin is clamped at 40
    assert candidate_signals(logits, greedy.log_probs(logits), 0, greedy)["margin"] == 40.0


def calibration_error(signal: EstimatorSignal, shift: float) -> float:
    """The mean |p̂ − p| over head scores 0.1 .. 0.9 and positions 1 .. 4, against p = σ(logit(â) + shift)."""
    errors = [abs(signal.acceptance(drafted(k, score=float(a))) - 1 / (1 + math.exp(-(drawn_logit(float(a)) + shift))))
              for a in np.linspace(0.1, 0.9, 9) for k in range(1, 5)]
    return float(np.mean(errors))


def test_the_online_calibration_of_a_head_follows_a_change_of_traffic_within_four_refits():
    """A head calibrated on the traffic it was trained for (p = â) meets traffic it overstates (p = σ(logit â − 1.5))
    from round 400: 16 rows a round drafting 4 candidates, outcomes up to each row's first rejection. Starting from the
    identity, the calibration stays within 0.03 of p while the head is right, is 0.25 off when the traffic changes,
    and is back within 0.05 four refits (400 rounds, about 8 000 checked candidates) later."""
    rng = np.random.default_rng(0)
    signal = head_signal(4)
    errors = {}
    for step in range(800):
        shift = 0.0 if step < 400 else -1.5
        if step % 100 == 0:
            errors[step] = calibration_error(signal, shift)
        rounds, outcomes = {}, {}
        for row in range(16):
            rounds[row] = [drafted(k, score=float(rng.uniform(0.05, 0.95))) for k in range(1, 5)]
            outcomes[row] = []
            for seen in rounds[row]:
                chance = 1 / (1 + math.exp(-(drawn_logit(seen.score) + shift)))
                outcomes[row].append(Outcome(seen.index, 0.5, bool(rng.uniform() < chance)))
                if not outcomes[row][-1].accepted:
                    break
        signal.observe(rounds, outcomes)
    errors[800] = calibration_error(signal, -1.5)
    assert max(errors[s] for s in (0, 100, 200, 300)) < 0.03 and errors[400] > 0.2
    assert errors[800] < 0.05, errors


def test_the_head_rules_refuse_what_they_cannot_use(tiny_pair):
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["q"], candidate_embedding_size=16)
    with pytest.raises(UsageError, match="expected_acceptance"):  # ranking by â read from the drawn token is lossy
        engine.decode([PROMPT], make_policy("goodput_online", 2), LENGTH, [0], on_time, costs=GPU)
    with pytest.raises(UsageError, match="cost ratio"):
        make_policy("head_cost_online", 2.0)
    with pytest.raises(UsageError, match="cost curves"):
        engine.decode([PROMPT], make_policy("vllm_current_adaptive", 2), LENGTH, [0])


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


GPU = ServingCosts(CostCurve((1, 256), (0.1, 0.12)), CostCurve((1, 256), (1.0, 1.1)))
SWITCHING = ServingCosts(CostCurve((1, 8), (0.31, 0.31)), CostCurve((1, 15, 20), (1.0, 1.0, 4.0)))
"""A draft costly enough that K = 1 pays only while acceptance is above about 0.6 (tests/test_planners.py's)."""
WIDE = ServingCosts(CostCurve((1, 8), (0.01, 0.08)), CostCurve((1, 25, 30), (1.0, 1.0, 4.0)))


def fast(signal: EstimatorSignal) -> EstimatorSignal:
    """`signal` refitting every 5 rounds, warm after one refit (a test serves too few rounds for 100)."""
    signal.fit.refit_every, signal.fit.warmup_refits = 5, min(signal.fit.warmup_refits, 1)
    return signal


def test_every_new_rule_and_planner_samples_the_target_distribution_at_batch_10(tiny_pair):
    """500 requests served 10 rows at a time with continuous batching under each rule, refitting every 5 rounds where
    it fits: the stop rules on vLLM's merged estimator, its margin revision, the per-request history, p_min and the
    head calibrated online (read from the costs, a random on-time head), and the goodput planner fed each estimate
    (the head's: a random expected-acceptance head), each seen to trim, leave every request's output the target's."""
    target, draft = tiny_pair
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    torch.manual_seed(5)
    expected_head = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy", "top1"]).eval()
    torch.nn.init.normal_(expected_head.out.weight, std=2.0)
    torch.nn.init.constant_(expected_head.out.bias, -2.0)
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["q"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(on_time.out.weight, std=2.0)
    cases = [("vllm_current", 0.5, SignalStop(fast(vllm_signal(2)), 0.5), None, None),
             ("vllm_margin", 0.5, SignalStop(fast(margin_signal(2)), 0.5), None, None),
             ("vllm_history", 0.5, None, None, None),
             ("pmin", 0.6, None, None, None),
             ("head_cost_online", 0.2, CalibratedCostPlanner(0.2, signal=fast(head_signal(2))), on_time, None),
             ("vllm_current_adaptive", 2, GoodputPlanner(SWITCHING, fast(vllm_signal(2)), max_k=2), None, SWITCHING),
             ("vllm_margin_adaptive", 2, GoodputPlanner(SWITCHING, fast(margin_signal(2)), max_k=2), None, SWITCHING),
             ("vllm_history_adaptive", 2, None, None, SWITCHING),
             ("goodput_online", 2, GoodputPlanner(WIDE, fast(head_signal(2)), max_k=2), expected_head, WIDE)]
    runs = 500
    for name, value, planner, head, costs in cases:
        log: list[RoundRecord] = []
        results = engine.decode([PROMPT] * runs, make_policy(name, value, max_draft=2), LENGTH, list(range(runs)), head,
                                batch_size=10, costs=costs, log=log, planner=planner)
        assert chi_square_p([tuple(r.tokens) for r in results], exact) > 1e-3, name
        assert sum(sum(r.emitted) for r in log) == runs * LENGTH
        pairs = [(v, d) for r in log for v, d in zip(r.verified, r.drafted)]
        trimmed = any(d < 2 for v, d in pairs if d) or any(v < d for v, d in pairs)
        assert trimmed and any(v == d > 0 for v, d in pairs), (name, sorted(set(pairs)))


def test_offline_online_scores_read_earlier_tokens_only_and_follow_the_labels():
    """eval's offline score of an online fit: a token is scored before its own outcome joins, refits every 100 tokens
    (as the vllm_online row); the head's calibration starts as the identity (its first 100 scores are σ(logit) exactly)
    and then finds a head that overstates every token by one logit."""
    from specheads.eval.offline import online_scores

    rng = np.random.default_rng(4)
    logit = rng.normal(0.0, 2.0, 20_000)
    label = 1 / (1 + np.exp(-(logit - 1.0)))
    scores = online_scores(np.c_[logit], (1.0, 0.0), label, seed=0)
    assert np.allclose(scores[:100], 1 / (1 + np.exp(-logit[:100]))) and not np.allclose(scores[100:200], 1 / (1 + np.exp(-logit[100:200])))
    changed = label.copy()
    changed[7000:] = 1 - changed[7000:]
    assert np.array_equal(online_scores(np.c_[logit], (1.0, 0.0), changed, seed=0)[:7001], scores[:7001])
    assert abs(np.mean(scores[-3000:] - label[-3000:])) < 0.01  # calibrated in the large, each refit on 100 tokens
    assert np.mean(np.abs(scores[-3000:] - label[-3000:])) < 0.05 < np.mean(np.abs(scores[:100] - label[:100]))


def test_offline_table_scores_the_margin_where_the_data_stores_top2_and_says_so_where_it_does_not():
    from specheads.eval.offline import TokenTable, offline_metrics

    rng = np.random.default_rng(5)
    n = 400
    top1 = rng.uniform(0.3, 0.95, n)
    arrays = {name: rng.uniform(0.01, 0.99, n) for name in ("label", "prediction", "beta", "accept")}
    table = TokenTable(**arrays, logit=rng.normal(size=n), logp=np.log(rng.uniform(0.01, 1, n)),
                       logq=np.log(rng.uniform(0.01, 1, n)), entropy=rng.uniform(0, 2, n), top1=top1,
                       group=np.repeat(np.arange(8), n // 8), row=np.repeat(np.arange(8), n // 8),
                       position=np.tile(np.arange(n // 8), 8), prompts=8)
    assert {"vllm_current", "head_online"} <= set(table.scores()) and "vllm_margin" not in table.scores()
    assert "top2" in table.margin_note and "vllm_margin" not in offline_metrics(table, resamples=5)["signals"]
    table.top2 = top1 * rng.uniform(0.0, 1.0, n)
    signals = offline_metrics(table, resamples=5)["signals"]
    assert {"vllm_margin", "head_online_margin"} <= set(signals) and table.margin_note is None
    assert signals["vllm_margin"]["ece"] is not None  # a probability: calibration scored beside the head's


def margin_table(n: int = 3000, seed: int = 6):
    """`n` held-out tokens of 30 prompts whose acceptance follows the top-2 logit margin m: σ(2 m − 3)."""
    from specheads.eval.offline import TokenTable

    rng = np.random.default_rng(seed)
    top1 = rng.uniform(0.2, 0.95, n)
    top2 = top1 * np.exp(-rng.uniform(0.0, 3.0, n))
    label = 1 / (1 + np.exp(-(2 * np.log(top1 / top2) - 3)))
    prompts = 30
    return TokenTable(label=label, prediction=rng.uniform(0.01, 0.99, n), logit=rng.normal(size=n), beta=label,
                      accept=label, logp=np.log(rng.uniform(0.01, 1, n)), logq=np.log(top1), entropy=rng.uniform(0, 2, n),
                      top1=top1, top2=top2, group=np.repeat(np.arange(prompts), n // prompts),
                      row=np.repeat(np.arange(prompts), n // prompts), position=np.tile(np.arange(n // prompts), prompts),
                      prompts=prompts)


def test_the_margin_fitted_offline_ranks_and_calibrates_as_the_margin_does_beside_the_heads_cumulative_ece():
    """3 000 held-out tokens whose acceptance follows the top-2 margin: fitted causally (a refit every 100 tokens, as
    the vllm_online row's estimator) the margin's score ranks them about as the margin itself does, a fit that waited
    for 6 400 tokens would score every one at its cold start (slope 0: AUC 0.5). Its cumulative ECE per round position
    sits beside the head's, and the head's paired AUC margin over it is reported."""
    from specheads.artifacts.metrics import soft_auc
    from specheads.eval.offline import cumulative_calibration, offline_metrics

    table = margin_table()
    margin = np.log(table.top1 / table.top2)
    scores = table.scores()
    offline = offline_metrics(table, resamples=20, scores=scores)
    assert offline["signals"]["vllm_margin"]["auc"] > soft_auc(table.label, margin) - 0.02 > 0.8
    comparison = offline["head_vs_top2_margin"]
    assert comparison["baseline"] == "vllm_margin" and comparison["auc_margin"] < -0.2  # a random head
    assert comparison["auc_margin_ci"][1] < 0
    rows = cumulative_calibration(table, None, 3, resamples=5, scores=scores)
    assert {r["stage"] for r in rows} == {"raw", "head_online", "head_online_margin", "vllm_current", "vllm_margin"}
    ece = {(r["stage"], r["k"]): r["ece"] for r in rows}
    assert all(ece["vllm_margin", k] < min(0.05, ece["raw", k]) for k in (1, 2, 3))  # the random head's, raw


def test_the_verdict_puts_the_head_beside_the_margin_or_says_which_labeller_scores_it():
    from types import SimpleNamespace

    from specheads.eval.offline import cumulative_calibration, offline_metrics
    from specheads.eval.report import margin_lines
    from specheads.eval.run import offline_comparison

    table = margin_table()
    scores = table.scores()
    offline = offline_metrics(table, resamples=5, scores=scores)
    report = SimpleNamespace(data={}, offline=offline["signals"], offline_comparison=offline_comparison(offline),
                             cumulative=cumulative_calibration(table, None, 2, resamples=5, scores=scores))
    [line] = margin_lines(report)
    assert line.startswith("Beside the top-2 logit margin") and "cumulative ECE at k = 1, 2" in line
    table.top2 = None
    report.data["margin_note"] = table.margin_note
    [line] = margin_lines(report)
    assert "labeller 3" in line and "label it again" in line


def test_the_calibration_rules_and_signals_are_found_by_name_where_the_planners_eval_and_transfer_look():
    """Every estimate refitted while serving is a signal of `planners.SIGNALS`, built fresh by name, and each goodput
    planner rule and stop rule on one reads it from there; the stop rules, the goodput planner and the rule read from
    the costs read and teach their signal through one piece (`SignalReader`); eval's --fixed-thresholds takes every
    per-request rule but the cost rules (refused with the reason), its sweep decodes vllm_margin, and
    --serving-batch-policies names every batch rule."""
    from specheads.decoding.planners import SIGNALS, GoodputPlan, SignalReader, make_signal
    from specheads.decoding.rules import BASELINES, BATCH_POLICIES, RULES, STOP_POLICIES
    from specheads.eval.config import COST_RULES, FIXED_POLICIES, SERVING_BATCH_POLICIES, EvalConfig
    from specheads.eval.sweep import default_settings

    cold = {"vllm_current": 1 / (1 + math.exp(0.2)), "vllm_margin": 1 / (1 + math.exp(-1.5)), "history": 0.7,
            "head_online": 0.25}
    for name, start in cold.items():
        first, second = make_signal(name, 3), make_signal(name, 3)
        assert first is not second and first.acceptance_at(0, drafted(1, top1=0.5, score=0.25)) == pytest.approx(start)
    for name in BATCH_POLICIES:
        rule = RULES[name]
        if issubclass(rule, GoodputPlan):
            planner = make_policy(name, 3).planner(GPU)
            assert rule.signal in SIGNALS and type(planner.signal) is type(make_signal(rule.signal, 3)), name
    for name in ("vllm_current", "vllm_margin", "vllm_history", "head_cost_online", "goodput_online"):
        planner = make_policy(name, 0.5 if name != "goodput_online" else 3).planner(GPU)
        assert isinstance(planner, SignalReader) and "read" not in type(planner).__dict__, name
    assert SERVING_BATCH_POLICIES == BATCH_POLICIES and set(BASELINES) <= set(FIXED_POLICIES)
    assert set(STOP_POLICIES) - set(COST_RULES) <= set(FIXED_POLICIES)
    EvalConfig(head="h", data="d", fixed_thresholds={"head": 0.6, "vllm_margin": 0.5, "pmin": 0.7}).validate()
    with pytest.raises(UsageError, match="head_cost_online, but the head's cost rule has no threshold"):
        EvalConfig(head="h", data="d", fixed_thresholds={"head": 0.6, "head_cost_online": 0.2}).validate()
    grid = {"svip": [1.0], "confidence": [0.5], "adaedl": [0.5], "pmin": [0.5]}
    swept = {setting.policy for setting in default_settings("stop", grid, 4, head_thresholds=[0.5])}
    assert {"vllm_current", "vllm_margin", "vllm_history", "pmin"} <= swept
