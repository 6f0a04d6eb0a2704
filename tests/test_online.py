"""Rules that adapt at run time (vLLM's online acceptance estimator, transformers' re-tuned confidence): their fits
use only outcomes observed earlier, recover what they should, and keep decoding exact."""

import math

import numpy as np
import pytest
from sklearn.metrics import roc_curve

from specheads.decoding import make_policy
from specheads.decoding.online import Outcome, TransformersConfidence, TransformersHeuristic, VllmEstimator, drawn_logit
from specheads.decoding.rules import Drafted
from specheads.plumbing.errors import UsageError


def drafted(index: int, prob: float) -> Drafted:
    return Drafted(index=index, prob=prob, entropy=1.0, acceptance=1.0)


def synthetic_rounds(seed: int, count: int, slope: float = 1.5, intercepts=(0.5, 0.0, -0.5)):
    """Rounds of up to 3 candidates whose acceptance follows σ(slope · logit(q) + b_k), ended at the first rejection."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(count):
        checked = []
        for position in (1, 2, 3):
            prob = float(rng.uniform(0.02, 0.98))
            accepted = rng.uniform() < 1 / (1 + math.exp(-(slope * drawn_logit(prob) + intercepts[position - 1])))
            checked.append(Outcome(position, prob, bool(accepted)))
            if not accepted:
                break
        rounds.append(checked)
    return rounds


def test_the_vllm_estimator_recovers_a_logistic_and_verifies_fully_until_its_third_refit():
    estimator = VllmEstimator(threshold=0.5, positions=3, window=400, refit_every=100)
    assert estimator.theta.tolist() == [0.0, 1.5, 1.5, 1.5]  # vLLM's start: w = 0, b = 1.5
    rounds = synthetic_rounds(0, 1200)
    for step, checked in enumerate(rounds):
        if step < 300:  # before the third refit it never stops a round: full verification
            assert not estimator.stops(0, drafted(1, 0.01))
        estimator.observe({0: checked})
    assert estimator.refits == 12
    assert estimator.theta[0] == pytest.approx(1.5, abs=0.3) and estimator.theta[1] > estimator.theta[3]
    assert estimator.stops(0, drafted(1, 0.02))  # a candidate q = 0.02: 1 − p > 0.5 ends the round
    assert not estimator.stops(1, drafted(1, 0.98))


def test_the_vllm_estimator_never_reads_an_outcome_from_the_future():
    """Two runs that share their first 250 steps and differ after have the same parameters and decisions up to there,
    and a refit reads only the window of the last 100 steps."""
    early, late_a, late_b = synthetic_rounds(1, 250), synthetic_rounds(2, 150), synthetic_rounds(3, 150)
    first, second = VllmEstimator(0.5, 3), VllmEstimator(0.5, 3)
    for checked in early:
        first.observe({0: checked})
        second.observe({0: checked})
    assert np.array_equal(first.theta, second.theta) and first.refits == second.refits == 2
    for a, b in zip(late_a, late_b):
        first.observe({0: a})
        second.observe({0: b})
    assert not np.array_equal(first.theta, second.theta)  # the third refit read the steps after 250
    windowed = VllmEstimator(0.5, 3)
    for checked in synthetic_rounds(4, 100) + late_a[:100]:  # 200 steps, the second hundred is late_a's first
        windowed.observe({0: checked})
    assert windowed.refits == 2 and len(windowed.window) == 100
    assert [s for step in windowed.window for s in step] == [(drawn_logit(o.prob), o.position, o.accepted)
                                                              for step in late_a[:100] for o in step]


def test_transformers_confidence_retunes_by_roc_from_the_requests_own_history():
    rule = TransformersConfidence()
    rule.admit(0)
    rule.admit(1)
    assert rule.threshold[0] == 0.4 and rule.stops(0, drafted(1, 0.39)) and not rule.stops(0, drafted(1, 0.41))
    outcomes = [Outcome(1, 0.9, True), Outcome(2, 0.8, True), Outcome(3, 0.3, False)]
    rule.observe({0: outcomes})
    assert rule.threshold[0] == 0.4  # 3 tokens: not yet more than 5
    more = [Outcome(1, 0.7, True), Outcome(2, 0.6, True), Outcome(3, 0.65, False)]
    rule.observe({0: more})
    probs, matches = [0.9, 0.8, 0.3, 0.7, 0.6, 0.65], [1, 1, 0, 1, 1, 0]
    fpr, tpr, thresholds = roc_curve(matches, probs)
    assert rule.threshold[0] == pytest.approx(min(thresholds[np.argmin(fpr + 3 * (1 - tpr))], 1.0)) != 0.4
    assert rule.threshold[1] == 0.4  # another request's row keeps its own threshold
    rule.admit(0)  # a new request starts again from 0.4 with an empty history, as each generate call of transformers
    assert rule.history[0] == ([], []) and rule.threshold[0] == 0.4
    assert make_policy("transformers", 0.4).max_draft == 20 and make_policy("transformers", 0.4).cap(100) == 20


def test_transformers_heuristic_schedule_adds_two_after_a_full_round_and_drops_one_otherwise():
    planner = make_policy("transformers_heuristic", 5).planner(None)
    planner.admit(0)
    planner.admit(1)
    assert isinstance(planner, TransformersHeuristic) and planner.k[0] == 5
    assert not planner.stops(0, drafted(4, 0.1)) and planner.stops(0, drafted(5, 0.99))
    planner.observe({0: [Outcome(i, 0.5, True) for i in range(1, 6)]})
    assert planner.k[0] == 7
    planner.observe({0: [Outcome(1, 0.5, True), Outcome(2, 0.5, False)]})
    assert planner.k == {0: 6, 1: 5}  # each request its own K
    planner.observe({1: []})  # a round with one token left drafts none: transformers counts that as all matched
    assert planner.k[1] == 7
    for _ in range(8):
        planner.observe({0: [Outcome(1, 0.5, False)]})
    assert planner.k[0] == 1  # never below one candidate
    planner.admit(0)  # a new request starts from 5 again, as each generate call of transformers
    assert planner.k[0] == 5
    rule = make_policy("transformers_heuristic", 5)
    assert rule.cap(100) == 99 and rule.cap(1) == 0  # one fewer than the tokens left, as transformers drafts
    assert rule.stop(Drafted(index=2, prob=0.9, entropy=1.0, acceptance=1.0, ends_output=True))  # EOS ends drafting
    with pytest.raises(UsageError, match="whole number"):
        make_policy("transformers_heuristic", 2.5)


def recorded_decodes(monkeypatch) -> list:
    """Replace the sweep's decoding by one that records (policy, prompt ids, planner) per call and returns runs."""
    from specheads.eval import sweep
    from specheads.eval.sweep import RunRecord

    calls = []

    def fake_decode_runs(engine, setting, prompts, seeds, head, max_new_tokens, max_draft, planner=None, likelihood=True):
        calls.append((setting.policy, [p.prompt_id for p in prompts], planner))
        return [RunRecord(setting.policy, setting.threshold, p.prompt_id, p.split, 3, 2, 1, 1, 2, 0.1, 0.1, [1], -1.0)
                for p in prompts]

    monkeypatch.setattr(sweep, "decode_runs", fake_decode_runs)
    return calls


def test_a_partly_finished_run_time_setting_is_decoded_again_from_its_start(monkeypatch):
    """Resuming a sweep takes finished runs of the per-row rules, but a rule that learns at run time from the runs
    before it is decoded again whole, so that its runs are those of an uninterrupted sweep; its state is handed from
    one batch of the setting to the next."""
    from specheads.eval.sweep import DecodePrompt, RunRecord, Setting, run_sweep

    calls = recorded_decodes(monkeypatch)
    prompts = [DecodePrompt("a", (1,), "dev"), DecodePrompt("b", (2,), "test")]
    settings = [Setting("constant_k", 2.0), Setting("vllm_online", 0.5)]
    finished = {(s.policy, s.threshold, "a"): RunRecord(s.policy, s.threshold, "a", "dev", 3, 2, 1, 1, 2, 0.1, 0.1, [1], -1.0)
                for s in settings}
    run_sweep(None, prompts, settings, None, 4, 3, progress=False, batch_size=1, finished=finished)
    assert [(policy, ids) for policy, ids, _ in calls] == [("constant_k", ["b"]), ("vllm_online", ["a"]), ("vllm_online", ["b"])]
    online = [planner for policy, _, planner in calls if policy == "vllm_online"]
    assert isinstance(online[0], VllmEstimator) and online[0] is online[1] and calls[0][2] is None


def test_the_offline_online_estimator_scores_each_token_from_the_tokens_before_it_only():
    """eval's offline vLLM score: a token's score never depends on its own or a later outcome, it starts at vLLM's
    prior σ(1.5) and, refitted every 100 tokens, comes to track a logistic of logit q(ŷ)."""
    from specheads.eval.offline import vllm_online_scores

    rng = np.random.default_rng(3)
    prob = rng.uniform(0.02, 0.98, 1200)
    label = 1 / (1 + np.exp(-(2.0 * np.log(prob / (1 - prob)) + 0.3)))
    scores = vllm_online_scores(prob, label, seed=0)
    changed = label.copy()
    changed[600:] = 1 - changed[600:]
    assert np.array_equal(vllm_online_scores(prob, changed, seed=0)[:601], scores[:601])
    assert np.allclose(scores[:100], 1 / (1 + math.exp(-1.5)))
    late = slice(800, None)
    assert np.mean(np.abs(scores[late] - label[late])) < 0.08


def test_adaedl_starts_as_svip_and_moves_its_lambda_with_the_requests_own_acceptance():
    """With no outcome yet AdaEDL's bound rule is SVIP's (1 − sqrt(0.2 H) < λ ⟺ sqrt(H) > (1 − λ)/sqrt(0.2)); a request
    whose candidates the target keeps accepting above the bound lowers its λ (drafts longer), one that rejects raises
    it, each request alone, and a new request starts again from λ."""
    from specheads.decoding.online import AdaEdl, adaedl_bound

    planner = make_policy("adaedl", 0.5).planner(None)
    assert isinstance(planner, AdaEdl)
    svip = make_policy("svip", (1 - 0.5) / math.sqrt(0.2))
    planner.admit(0)
    planner.admit(1)
    for entropy in np.linspace(0.0, 3.0, 31):
        seen = Drafted(index=1, prob=0.5, entropy=float(entropy), acceptance=1.0)
        assert planner.stops(0, seen) == svip.signal_says_stop(seen)
    entropy = 1.6  # bound 0.434: stops at λ = 0.5 before any outcome
    seen = Drafted(index=1, prob=0.5, entropy=entropy, acceptance=1.0)
    assert planner.stops(0, seen) and planner.stops(1, seen)
    for _ in range(10):
        planner.observe({0: [Outcome(1, 0.5, True, entropy)], 1: [Outcome(1, 0.5, False, entropy)]})
    expected = 0.0
    for _ in range(10):
        expected += 0.1 * (1.0 - adaedl_bound(entropy) - expected)
    assert planner.slack[0] == pytest.approx(expected) and planner.slack[1] < 0
    assert not planner.stops(0, seen) and planner.stops(1, seen)
    planner.admit(0)
    assert planner.slack[0] == 0.0 and planner.stops(0, seen)


def test_adaedl_never_reads_an_outcome_from_the_future():
    """Two requests that share their first 40 outcomes have the same λ up to there; a later outcome moves it. The
    offline score of a held-out token reads only the outcomes of its response before it, and restarts per response."""
    from specheads.decoding.online import AdaEdl
    from specheads.eval.offline import adaedl_scores

    rng = np.random.default_rng(7)
    shared = [Outcome(1, 0.5, bool(a), float(h)) for a, h in zip(rng.uniform(size=40) < 0.6, rng.uniform(0, 3, 40))]
    first, second = AdaEdl(0.5), AdaEdl(0.5)
    for planner in (first, second):
        planner.admit(0)
        for outcome in shared:
            planner.observe({0: [outcome]})
    assert first.slack == second.slack
    first.observe({0: [Outcome(1, 0.5, True, 2.0)]})
    second.observe({0: [Outcome(1, 0.5, False, 2.0)]})
    assert first.slack[0] > second.slack[0]
    entropy = rng.uniform(0, 3, 300)
    label = rng.uniform(size=300)
    row = np.repeat([0, 1, 2], 100)
    scores = adaedl_scores(entropy, label, row, seed=0)
    changed = label.copy()
    changed[150:] = 1 - changed[150:]
    assert np.array_equal(adaedl_scores(entropy, changed, row, seed=0)[:151], scores[:151])
    assert scores[100] == pytest.approx(1 - math.sqrt(0.2 * entropy[100]))  # a new response starts again at δ = 0


def test_sglangs_adaptive_k_follows_its_ema_of_accepted_lengths_as_computed_by_hand():
    """SGLang PR #21599's update: K starts at the candidate nearest the configured steps (ties: the larger) and the EMA
    at K − 1; each verify step folds in the batch's mean accepted length with weight 0.2; the first 10 steps only warm
    the EMA up, then every 5th step K moves down while ema ≤ lower − 0.75, else up while ema > K − 0.5. The state is the
    server's: a new request keeps it."""
    from specheads.decoding.online import SglangAdaptive

    assert [SglangAdaptive(start).k for start in (1, 2, 3, 4, 5, 6, 9)] == [1, 3, 3, 3, 7, 7, 7]
    planner = make_policy("sglang_adaptive", 3, max_draft=8).planner(None)
    assert isinstance(planner, SglangAdaptive) and (planner.k, planner.ema) == (3, 2.0)
    rejected, accepted = Outcome(1, 0.5, False), Outcome(1, 0.5, True)
    ema = 2.0
    for step in range(1, 16):  # every row rejects its first candidate: mean accepted length 0
        planner.observe({0: [rejected], 1: [rejected], 2: []})  # a row that drafted nothing is not counted
        ema *= 0.8
        assert planner.ema == pytest.approx(ema) and planner.steps == step
        assert planner.round_cap(3, 8) == (3 if step < 15 else 1)  # 2 · 0.8^15 = 0.070 ≤ 1 − 0.5 − 0.25 at step 15
    assert planner.ema == pytest.approx(2 * 0.8**15)
    planner.observe({0: []})  # no row drafted: no verify step
    assert planner.steps == 15
    planner.admit(0)  # a new request: SGLang's state is the server's, not the request's
    assert planner.k == 1
    for _ in range(5):  # rows [accepted, accepted + rejected]: lengths 1 and 1
        planner.observe({0: [accepted], 1: [accepted, Outcome(2, 0.5, False)]})
        ema = 0.8 * ema + 0.2 * 1.0
    assert planner.ema == pytest.approx(1 - (1 - 2 * 0.8**15) * 0.8**5)  # 0.695 > 1 − 0.5: up to 3, not past 3 − 0.5
    assert planner.k == 3 and planner.round_cap(4, 2) == 2  # a row never drafts past its cap
    planner.k, planner.ema = 1, 2.6  # one recomputation may move several candidates: 2.6 > 0.5 and > 2.5
    assert planner.next_k() == 7
    planner.k, planner.ema = 7, 0.2  # 0.2 ≤ 3 − 0.75 and ≤ 1 − 0.75
    assert planner.next_k() == 1
    planner.k, planner.ema = 7, 2.25  # at the bound: down to 3, and 2.25 ≤ 2.5 keeps it from rising back
    assert planner.next_k() == 3
    with pytest.raises(UsageError, match="number of draft steps must be a whole number"):
        make_policy("sglang_adaptive", 2.5)


def test_sglangs_adaptive_k_samples_the_target_distribution_while_k_moves():
    """500 requests served 10 rows at a time: SGLang's rule at its defaults, and a configuration whose K moves between
    1 and 2 after every round (warm-up 0, EMA weight 1, a high bar to keep K = 2), leave every request's output the
    target's distribution: K is read from earlier rounds only."""
    from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

    from specheads.decoding import RoundEngine
    from specheads.decoding.costs import RoundRecord
    from specheads.decoding.online import SglangAdaptive
    from specheads.model_outputs.sampling import SamplingTransform

    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    runs = 500
    moving = SglangAdaptive(2, candidates=(1, 2), alpha=1.0, update_interval=1, warmup=0, down_hysteresis=1.5)
    for name, planner in (("defaults", None), ("moving", moving)):
        log: list[RoundRecord] = []
        results = engine.decode([PROMPT] * runs, make_policy("sglang_adaptive", 3, max_draft=3), LENGTH,
                                list(range(runs)), None, batch_size=10, log=log, planner=planner)
        assert chi_square_p([tuple(r.tokens) for r in results], exact) > 1e-3, name
        if name == "moving":  # rounds of one candidate per row and rounds of two, chosen by the outcomes before them
            assert {max(r.drafted) for r in log if len(r.drafted) == 10} == {1, 2}


def test_every_rule_is_registered_for_a_process_that_imports_only_the_rules_module():
    """The rules of the modules above `rules.py` register themselves there; importing `specheads.decoding.rules`
    imports the package first, which imports them all, so no named rule is missing from `RULES`."""
    import subprocess
    import sys

    code = ("from specheads.decoding.rules import BASELINES, BATCH_POLICIES, FREE_DRAFT_RULES, ONLINE_POLICIES, RULES, "
            "STOP_POLICIES\n"
            "named = {*BASELINES, *BATCH_POLICIES, *FREE_DRAFT_RULES, *ONLINE_POLICIES, *STOP_POLICIES, 'sprinter'}\n"
            "print(sorted(named - set(RULES)), sorted(set(RULES) - named))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[] []", done.stdout + done.stderr
