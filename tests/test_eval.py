"""`specheads eval`: metrics against scikit-learn and hand values, the decoding loops' exactness, the report."""

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_args
from scipy.stats import chisquare
from sklearn.metrics import brier_score_loss, roc_auc_score
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.artifacts.checkpoint import load_trained
from specheads.artifacts.metrics import binary_kl, brier, expected_calibration_error, soft_auc
from specheads.artifacts.report_file import Report, read_report
from specheads.cli import main
from specheads.dataset.prompts import prompt_digest
from specheads.dataset.store import load_labelled
from specheads.decoding import BatchCache, RoundEngine, make_policy
from specheads.decoding.rules import BASELINES, ONLINE_POLICIES
from specheads.demo.summary import decoding_line
from specheads.eval.offline import TokenTable, bootstrap_indices, offline_metrics, sprinter_distance, sprinter_operating_points
from specheads.eval.plots import pareto_frontier
from specheads.eval.report import decoding_verdict, grid_edge_lines, measured_costs_note
from specheads.eval.run import check_data
from specheads.eval.sweep import (
    RunRecord,
    Setting,
    aggregate,
    eq_5_1_speedup,
    grid_edges,
    measure_costs,
    modelled_speedup,
    paired_gain_interval,
)
from specheads.heads import LinearVerifier, OnTimeAcceptanceHead, ResNetAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

VOCAB, LENGTH, PROMPT = 3, 3, [0, 1]


# ---- metrics


def test_soft_metrics_equal_sklearn_on_binary_labels_and_hand_values():
    rng = np.random.default_rng(0)
    labels = (rng.random(300) < 0.6).astype(float)
    scores = np.clip(labels * 0.3 + rng.random(300) * 0.7, 0, 1)
    assert soft_auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores))
    assert brier(labels, scores) == pytest.approx(brier_score_loss(labels, scores))
    # binary KL by hand: a = 0.5, â = 0.25 -> 0.5·log 2 + 0.5·log(2/3); a = 1, â = 0.5 -> log 2
    expected = (0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75) + math.log(2)) / 2
    assert binary_kl(np.array([0.5, 1.0]), np.array([0.25, 0.5])) == pytest.approx(expected)
    # ECE by hand: bin [0.2, 0.3) holds predictions 0.25 (labels 1, 0) -> |0.5 − 0.25| = 0.25
    assert expected_calibration_error(np.array([1.0, 0.0]), np.array([0.25, 0.25])) == pytest.approx(0.25)
    # a soft label counts as a positive weighted a and a negative weighted 1 − a: the a = 0.3 token ties with
    # itself (weight 0.3·0.7, counted half), the a = 1 token outranks it (weight 1·0.7); total weight 1.3·0.7
    assert soft_auc(np.array([0.3, 1.0]), np.array([0.1, 0.9])) == pytest.approx((0.3 * 0.7 * 0.5 + 0.7) / (1.3 * 0.7))


def test_roc_of_a_perfect_and_a_random_scorer():
    rng = np.random.default_rng(1)
    labels = (rng.random(4000) < 0.5).astype(float)
    assert soft_auc(labels, labels + 0.01 * rng.random(4000)) == pytest.approx(1.0)
    assert abs(soft_auc(labels, rng.random(4000)) - 0.5) < 0.03


def table_of(labels: np.ndarray, prediction: np.ndarray, groups: np.ndarray) -> TokenTable:
    n = len(labels)
    return TokenTable(label=labels, prediction=prediction, logit=np.log(prediction) - np.log1p(-prediction),
                      logp=np.log(np.full(n, 0.5)), logq=np.log(np.full(n, 0.6)), entropy=np.ones(n), top1=np.full(n, 0.5),
                      beta=np.full(n, 0.8), accept=np.full(n, 0.8), group=groups, row=np.arange(n), position=np.zeros(n, int),
                      prompts=int(groups.max()) + 1)


def test_bootstrap_resamples_whole_prompts_and_intervals_cover_the_estimate():
    groups = np.repeat(np.arange(10), 30)
    for index in bootstrap_indices(groups, 5, seed=0):
        counts = np.bincount(groups[index], minlength=10)
        assert set(counts.tolist()) <= {0, 30, 60, 90, 120, 150}  # whole prompts only
    rng = np.random.default_rng(2)
    labels = rng.random(300)
    table = table_of(labels, np.clip(labels + rng.normal(0, 0.2, 300), 0.01, 0.99), groups)
    result = offline_metrics(table, resamples=100, seed=0)
    head = result["signals"]["head"]
    assert head["auc_ci"][0] <= head["auc"] <= head["auc_ci"][1]
    assert head["binary_kl_ci"][0] <= head["binary_kl"] <= head["binary_kl_ci"][1]
    assert result["signals"]["svip_entropy"]["binary_kl"] is None  # not a probability
    assert result["signals"]["label_ceiling"]["binary_kl"] == pytest.approx(0.0)


def sprinter_step_by_enumeration(q: np.ndarray, p: np.ndarray, passed: np.ndarray) -> np.ndarray:
    """SPRINTER's output distribution for one token, summed over every draw: a passed ŷ ~ q is kept; any other is
    accepted with probability min(1, p/q) or replaced by a draw from norm(max(0, p − q))."""
    residual = np.maximum(p - q, 0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else residual
    out = np.zeros_like(q)
    for token, mass in enumerate(q):
        if passed[token]:
            out[token] += mass
        else:
            kept = min(1.0, p[token] / mass)
            out[token] += mass * kept
            out += mass * (1.0 - kept) * residual
    return out


def drafted_tokens(q_counts: list[int], p: np.ndarray, passed: np.ndarray) -> TokenTable:
    """Every draft of a q with denominator sum(q_counts), each token as often as q draws it, with its stored label."""
    q = np.array(q_counts) / sum(q_counts)
    tokens = np.repeat(np.arange(len(q)), q_counts)
    table = table_of(np.zeros(len(tokens)), passed[tokens].astype(float), np.zeros(len(tokens), dtype=int))
    table.logq, table.logp = np.log(q[tokens]), np.log(np.maximum(p[tokens], 1e-300))
    table.accept = np.minimum(1.0, p[tokens] / q[tokens])
    return table


def test_sprinter_distance_equals_the_exact_enumeration():
    # the hand case: q = (0.5, 0.3, 0.2), p = (0, 0.29, 0.71), the verifier passes only the first token
    p, passed = np.array([0.0, 0.29, 0.71]), np.array([True, False, False])
    output = sprinter_step_by_enumeration(np.array([0.5, 0.3, 0.2]), p, passed)
    assert 0.5 * np.abs(output - p).sum() == pytest.approx(0.50)
    assert sprinter_distance(drafted_tokens([5, 3, 2], p, passed), 0.5) == pytest.approx(0.50)
    rng = np.random.default_rng(3)
    for _ in range(50):  # random pairs on a 6-token vocabulary, random pass sets
        counts = rng.integers(1, 9, 6).tolist()
        p, passed = rng.dirichlet(np.ones(6) * 0.7), rng.random(6) < 0.5
        exact = 0.5 * np.abs(sprinter_step_by_enumeration(np.array(counts) / sum(counts), p, passed) - p).sum()
        assert sprinter_distance(drafted_tokens(counts, p, passed), 0.5) == pytest.approx(exact, abs=1e-12)
    # verifying everything is exact; passing everything is the draft's own distance 1 − β
    assert sprinter_distance(drafted_tokens(counts, p, np.zeros(6, bool)), 0.5) == 0.0
    q = np.array(counts) / sum(counts)
    everything = sprinter_distance(drafted_tokens(counts, p, np.ones(6, bool)), 0.5)
    assert everything == pytest.approx(1.0 - np.minimum(p, q).sum())


def test_sprinter_operating_points_count_false_and_true_positives_per_tau():
    labels = np.array([1.0, 1.0, 0.0, 0.0])
    table = table_of(labels, np.array([0.9, 0.2, 0.8, 0.1]), np.zeros(4, dtype=int))
    table.logp, table.logq = np.log([0.5, 0.5, 0.1, 0.1]), np.log([0.4, 0.4, 0.4, 0.4])
    table.accept = np.minimum(1.0, np.exp(table.logp - table.logq))
    result = sprinter_operating_points(table, threshold=0.5, taus=(1.0, 5.0))
    assert result["operating_points"][0] == {"tau": 1.0, "fpr": 0.5, "tpr": 0.5}
    assert result["operating_points"][1] == {"tau": 5.0, "fpr": 0.0, "tpr": 0.5}  # q/p = 4 is acceptable at τ = 5
    # the passed tokens are the first (accept 1) and the third (accept 0.25): (0 + 0.75) / 4
    assert result["tv_distance"] == pytest.approx(0.75 / 4) and result["passed_share"] == 0.5


def timed_run(policy: str, threshold: float, drafts: int, calls: int, t_draft: float = 0.01, t_target: float = 0.05,
              prompt: str = "") -> RunRecord:
    """A run whose draft made `drafts` passes of `t_draft` s and whose target made `calls` of `t_target` s."""
    return RunRecord(policy, threshold, prompt or f"p{drafts}-{calls}", "test", emitted=20, drafted=drafts,
                     accepted=drafts // 2, target_calls=calls, draft_forwards=drafts,
                     seconds=t_draft * drafts + t_target * calls + 1e-3, forward_seconds=t_draft * drafts + t_target * calls,
                     accepted_per_round=[1], target_logprob=-1.0, draft_seconds=t_draft * drafts,
                     target_seconds=t_target * calls, draft_passes=drafts, target_passes=calls)


def test_modelled_speedup_aggregation_and_measured_forward_times():
    # target-only decoding: one target call per token and no draft forward
    assert modelled_speedup(10, 0, 10, 0.2) == pytest.approx(1.0)
    # 40 tokens from 30 draft forwards and 10 target calls: 40 / (0.2·30 + 10)
    assert modelled_speedup(40, 30, 10, 0.2) == pytest.approx(2.5)
    assert eq_5_1_speedup(0.5, 0.25, 0.2) == pytest.approx(1.0 / (0.2 * 1.5 + 0.8 * 0.25))
    records = [timed_run("constant_k", float(k), drafts, calls)
               for k, (drafts, calls) in enumerate([(10, 5), (20, 4), (6, 6), (30, 3)] * 2)]
    costs = measure_costs(records)
    assert costs["t_draft_s"] == pytest.approx(0.01) and costs["ratio"] == pytest.approx(0.2)
    assert costs["ratio_ci"] == pytest.approx([0.2, 0.2]) and costs["reliable"] and costs["caveat"] is None
    assert "measured ratio is 0.200 [0.200, 0.200]" in measured_costs_note(costs)
    one_setting = [timed_run("constant_k", 2.0, drafts, calls) for drafts, calls in [(10, 5), (20, 4), (6, 6), (30, 3)]]
    row = aggregate(one_setting, "test", 0.2, costs["ratio"])[0]
    assert row["discard_rate"] == pytest.approx(sum(d - d // 2 for d in (10, 20, 6, 30)) / 80)
    assert row["verification_rate"] == pytest.approx(18 / 80)
    assert row["modelled_speedup"] == pytest.approx(80 / (0.2 * 66 + 18))  # 66 draft forwards, 18 target calls


def test_a_measured_ratio_that_varies_between_settings_or_rests_on_few_passes_is_marked_unreliable():
    noisy = [timed_run("constant_k", float(k), 20, 10, t_draft=t) for k, t in enumerate([0.001, 0.02, 0.05, 0.004, 0.03])]
    costs = measure_costs(noisy)
    assert costs["ratio"] is not None and not costs["reliable"] and "interval" in costs["caveat"]
    note = measured_costs_note(costs)
    assert "unreliable" in note and "do not use it" in note
    few = measure_costs([timed_run("constant_k", 1.0, 3, 2), timed_run("constant_k", 2.0, 4, 2)])
    assert not few["reliable"] and "forward passes" in few["caveat"]


def test_cost_measurement_leaves_undetermined_what_the_runs_do_not_determine():
    never_verified = [timed_run("sprinter", 0.0, 20, 0), timed_run("sprinter", 0.0, 24, 0)]  # every token passed
    costs = measure_costs(never_verified)
    assert costs["t_target_s"] is None and costs["ratio"] is None and "called the target" in costs["undetermined"]
    assert costs["t_draft_s"] == pytest.approx(0.01)
    row = aggregate(never_verified, "test", 0.2, costs["ratio"])[0]
    assert row["verification_rate"] == 0 and row["modelled_speedup_measured_ratio"] is None
    # counted: 40 tokens from 44 draft forwards and no target call (Eq. 5.1 would count 22 discarded tokens instead)
    assert row["modelled_speedup"] == pytest.approx(40 / (0.2 * 44))
    # a zero measured ratio with no target call models no time at all: no figure rather than a division by zero
    assert aggregate(never_verified, "test", 0.2, 0.0)[0]["modelled_speedup_measured_ratio"] is None
    assert "do not determine the ratio" in measured_costs_note(costs)


def test_the_verdict_and_the_demo_summary_name_the_strongest_free_rule_and_the_heads_margin_over_it():
    rows = [{"policy": "head", "threshold": 0.5, "tuned": True, "modelled_speedup": 1.5},
            {"policy": "constant_k", "threshold": 2.0, "tuned": True, "modelled_speedup": 1.4},
            {"policy": "vllm_online", "threshold": 0.3, "tuned": True, "modelled_speedup": 1.46},
            {"policy": "transformers", "threshold": 0.4, "tuned": True, "modelled_speedup": 1.2}]
    decoding = {"policies": rows, "prompts": {"dev": 40, "test": 40}, "max_new_tokens": 24, "t_draft_over_t_target": 0.2,
                "gain_intervals": {"vllm_online": [-0.01, 0.06], "constant_k": [0.02, 0.1], "transformers": [0.1, 0.4]}}
    result, lines = decoding_verdict(decoding)
    assert result["strongest_baseline"] == "vllm_online" and result["strongest_baseline_speedup"] == 1.46
    assert result["gain_vs_strongest_baseline"] == pytest.approx(1.5 / 1.46 - 1)
    assert any("strongest free rule on the test prompts is vllm_online" in line and "a free rule does as well" in line
               for line in lines)  # its interval includes zero
    assert "adaedl" in result["baselines_not_decoded"] and "vllm_online" not in result["baselines_not_decoded"]
    assert any(line.startswith("Not decoded here") and "svip" in line for line in lines)
    line = decoding_line({"decoding": {**result, "t_draft_over_t_target": 0.2, "max_new_tokens": 24}})
    assert "vs the strongest field rule, vllm_online 1.460x: +2.7 % [-1.0, +6.0 %]" in line


def test_a_decoding_verdict_on_few_test_prompts_is_called_indicative():
    def decoding(test_prompts: int) -> dict:
        rows = [{"policy": "head", "threshold": 0.5, "tuned": True, "modelled_speedup": 1.5},
                {"policy": "constant_k", "threshold": 2.0, "tuned": True, "modelled_speedup": 1.4}]
        return {"policies": rows, "prompts": {"dev": test_prompts, "test": test_prompts}, "max_new_tokens": 24,
                "t_draft_over_t_target": 0.2, "gain_intervals": {}}

    few, lines = decoding_verdict(decoding(3))
    assert few["indicative"] and few["test_prompts"] == 3
    assert "rest on 3 test prompts" in lines[0] and "indicative only, not a finding" in lines[0]
    enough, lines = decoding_verdict(decoding(8))
    assert not enough["indicative"] and "indicative" not in " ".join(lines)
    summary = {"decoding": {**few, "t_draft_over_t_target": 0.2, "max_new_tokens": 24}}
    assert "indicative only, not a finding: fewer than 8 test prompts" in decoding_line(summary)
    assert "indicative" not in decoding_line({"decoding": {**enough, "t_draft_over_t_target": 0.2, "max_new_tokens": 24}})


def test_the_oracle_is_worded_as_a_bound_in_expectation_and_a_policy_beating_it_is_flagged():
    def decoding(svip_speedup: float) -> dict:
        rows = [{"policy": "head", "threshold": 0.5, "tuned": True, "modelled_speedup": 1.5},
                {"policy": "svip", "threshold": 1.2, "tuned": True, "modelled_speedup": svip_speedup},
                {"policy": "svip", "threshold": 0.8, "tuned": False, "modelled_speedup": 1.3},
                {"policy": "oracle", "threshold": 6.0, "tuned": True, "modelled_speedup": 1.757}]
        return {"policies": rows, "prompts": {"dev": 1, "test": 1}, "max_new_tokens": 24,
                "t_draft_over_t_target": 0.2, "gain_intervals": {}}

    beaten, lines = decoding_verdict(decoding(1.857))
    text = " ".join(lines)
    assert "bounds what any stop policy can reach" not in text and "in expectation, not on every small sample" in text
    assert beaten["beat_the_oracle"] == ["svip"] and "svip (1.857× at 1.2) beats the oracle" in text
    below, lines = decoding_verdict(decoding(1.6))
    assert below["beat_the_oracle"] == [] and "beat" not in " ".join(lines)


@pytest.mark.parametrize("sprinter_logprob, words", [(-2.5, "-0.300 nats/token (lower than exact SD)"),
                                                     (-1.9, "+0.300 nats/token (higher than exact SD)")])
def test_sprinter_quality_proxy_has_one_sign_in_report_and_demo_summary(sprinter_logprob: float, words: str):
    rows = [{"policy": "sprinter", "threshold": 0.7, "tuned": True, "modelled_speedup": 1.3, "tokens_per_target_call": 1.6,
             "mean_target_logprob": sprinter_logprob},
            {"policy": "constant_k", "threshold": 3.0, "tuned": True, "modelled_speedup": 1.4,
             "tokens_per_target_call": 2.2, "mean_target_logprob": -2.2}]
    result, lines = decoding_verdict({"policies": rows, "prompts": {"dev": 8, "test": 8}, "max_new_tokens": 24,
                                      "t_draft_over_t_target": 0.2, "gain_intervals": {}})
    assert words in " ".join(lines)
    assert words in decoding_line({"decoding": {**result, "t_draft_over_t_target": 0.2, "max_new_tokens": 24}})


def test_the_pareto_plot_draws_the_frontier_not_the_threshold_order():
    points = [(0.1, 0.6), (0.3, 0.45), (0.2, 0.65), (0.4, 0.5), (0.5, 0.3), (0.5, 0.35)]
    assert pareto_frontier(points) == [(0.1, 0.6), (0.3, 0.45), (0.5, 0.3)]


def test_paired_gain_interval_resamples_prompts_for_both_policies():
    def run(policy: str, prompt: int, calls: int) -> RunRecord:
        return RunRecord(policy, 1.0, f"p{prompt}", "test", emitted=20, drafted=12, accepted=8, target_calls=calls,
                         draft_forwards=12, seconds=1.0, forward_seconds=1.0, accepted_per_round=[2], target_logprob=-1.0)

    head, constant = Setting("head", 1.0), Setting("constant_k", 1.0)
    same = [run(policy, i, 5 + i) for policy in ("head", "constant_k") for i in range(8)]
    assert paired_gain_interval(same, head, constant, 0.2) == pytest.approx([0.0, 0.0])
    # the head saves one target call on every prompt: the interval lies above zero and holds the point gain
    better = [run("head", i, 4 + i) for i in range(8)] + [run("constant_k", i, 5 + i) for i in range(8)]
    rows = {row["policy"]: row for row in aggregate(better, "test", 0.2, 0.2)}
    gain = rows["head"]["modelled_speedup"] / rows["constant_k"]["modelled_speedup"] - 1
    low, high = paired_gain_interval(better, head, constant, 0.2, resamples=500, seed=1)
    assert 0 < low <= gain <= high
    # a prompt that saves many calls widens the interval; one shared prompt gives none
    mixed = better + [run("head", 8, 2), run("constant_k", 8, 12)]
    wide = paired_gain_interval(mixed, head, constant, 0.2, resamples=500, seed=1)
    assert wide[1] - wide[0] > high - low
    assert paired_gain_interval(better[:1] + better[8:9], head, constant, 0.2) is None


def test_a_threshold_tuned_at_an_end_of_its_grid_is_flagged_in_the_report():
    dev = [{"policy": policy, "threshold": t} for policy, grid in
           (("constant_k", (1, 2, 4)), ("confidence", (0.01, 0.1, 0.34)), ("svip", (1.4, 1.8)), ("head", (0.3, 0.45, 0.6)),
            ("oracle", (6,)))
           for t in grid]
    tuned = {"constant_k": 1, "confidence": 0.34, "svip": 1.4, "head": 0.45, "oracle": 6}
    edges = grid_edges(dev, tuned)
    # K = 1 has nothing below it; the head's pick is inside its grid; the oracle has no grid
    assert edges == {"confidence": "highest", "svip": "lowest"}
    assert grid_edges(dev, {**tuned, "constant_k": 4})["constant_k"] == "highest"
    warnings = grid_edge_lines({"tuned_at_grid_edge": edges, "tuned_thresholds": tuned})
    assert len(warnings) == 2 and "0.34 is the highest" in warnings[0] and "--stop-shares" in warnings[0]


# ---- the decoding loops on a tiny model with a small vocabulary


def tiny_lm(seed: int, vocab: int = VOCAB, init: float = 0.35) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, initializer_range=init, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


@torch.no_grad()
def sequence_probabilities(model, transform: SamplingTransform, length: int = LENGTH, prompt: list[int] = PROMPT,
                           vocab: int = VOCAB) -> dict[tuple[int, ...], float]:
    """The exact distribution of `length` tokens after `prompt`, by enumeration over a `vocab`-token vocabulary."""
    result = {}
    for tail in itertools.product(range(vocab), repeat=length):
        logits = model(torch.tensor([prompt + list(tail)])).logits[0]
        log_probs = transform.log_probs(logits)
        result[tail] = float(np.prod([log_probs[len(prompt) - 1 + i, t].exp().item() for i, t in enumerate(tail)]))
    return result


def chi_square_p(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    keys = sorted(expected)
    observed = np.array([sum(1 for s in samples if s == k) for k in keys], dtype=float)
    probabilities = np.array([expected[k] for k in keys])
    return float(chisquare(observed, probabilities / probabilities.sum() * len(samples)).pvalue)


def test_cache_cropping_gives_the_logits_of_a_fresh_forward(tiny_pair):
    target, _ = tiny_pair
    runner = BatchCache(target, 1)
    runner.feed({0: [0, 1, 2, 0, 1, 1, 2]})
    runner.crop_row(0, 4)
    runner.trim()
    cached, _ = runner.feed({0: [2]})[0]
    fresh = target(torch.tensor([[0, 1, 2, 0, 2]])).logits[0, -1].float()
    assert runner.length(0) == 5 and torch.allclose(cached[-1], fresh, atol=1e-5)


def test_a_refilled_row_is_compacted_to_the_front_of_the_cache_and_gives_the_logits_of_a_fresh_forward(tiny_pair):
    """Continuous batching: row 0 finishes a long request and takes a short one; once most slots are masked the cache
    is compacted, and both rows still see exactly their own tokens at their own positions."""
    target, _ = tiny_pair
    runner = BatchCache(target, 2)
    runner.feed({0: [0, 1, 2, 0, 1, 1, 2, 0, 1, 2], 1: [2, 1]})
    runner.crop_row(0, 0)  # the request finished: its slots are masked, the row takes a new prompt
    runner.feed({0: [1, 0]})
    runner.trim()
    assert runner.mask.shape[1] == 2 and runner.slots == [[0, 1], [0, 1]]  # 12 slots, 4 live: compacted
    cached = runner.feed({0: [2], 1: [0]})
    for row, tokens in ((0, [1, 0, 2]), (1, [2, 1, 0])):
        fresh = target(torch.tensor([tokens])).logits[0, -1].float()
        assert torch.allclose(cached[row][0][-1], fresh, atol=1e-5), row


POLICIES = [("constant_k", 2), ("svip", 1.0), ("confidence", 0.4), ("head", 0.5), ("oracle", 3)]


def test_speculative_sampling_leaves_the_target_distribution_unchanged(tiny_pair):
    """Every stop policy, and SPRINTER when it verifies every token, samples exactly the target's distribution.

    The 500 runs of a policy are decoded 100 rows at a time: each row draws from its own generator, so a row's
    tokens are the ones it gets decoded alone (tests/test_batched.py checks that in float64) and the rows are
    independent samples."""
    target, draft = tiny_pair
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    assert 0.15 < sum(abs(exact[k] - v) for k, v in sequence_probabilities(draft, transform).items()) / 2
    decoder = RoundEngine(target, draft, transform, stop_ids=[])

    def samples(policy, head, runs: int = 500, batch: int = 100) -> list[tuple[int, ...]]:
        return [tuple(result.tokens) for first in range(0, runs, batch)
                for result in decoder.decode([PROMPT] * batch, policy, LENGTH, list(range(first, first + batch)), head)]

    head = ResNetAcceptanceHead(16, depth=1, extra_features=["logq", "entropy"])
    torch.nn.init.normal_(head.out.weight, std=2.0)  # a head whose stop decisions vary with the state
    for name, threshold in POLICIES:
        assert chi_square_p(samples(make_policy(name, threshold, max_draft=3), head), exact) > 1e-3, name
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16)
    torch.nn.init.normal_(on_time.out.weight, std=2.0)  # the head policy stopping at the candidate it scores
    assert chi_square_p(samples(make_policy("head", 0.5, max_draft=3), on_time), exact) > 1e-3, "on-time head"
    verifier = LinearVerifier(16)
    assert chi_square_p(samples(make_policy("sprinter", 1.01), verifier), exact) > 1e-3, "sprinter verifying every token"
    # the test has power: sampling the draft alone is detected
    assert chi_square_p(samples(make_policy("sprinter", 0.0), verifier), exact) < 1e-6


def test_greedy_oracle_never_discards_and_every_policy_reproduces_greedy_target(tiny_pair):
    target, draft = tiny_lm(seed=3, vocab=11), tiny_lm(seed=4, vocab=11)
    transform = SamplingTransform(0.0)
    decoder = RoundEngine(target, draft, transform, stop_ids=[])
    prompt = [1, 2, 3]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    head = ResNetAcceptanceHead(16, depth=0)
    for name, threshold in POLICIES:
        result = decoder.decode_one(prompt, make_policy(name, threshold, max_draft=4), 12, seed=0, head=head)
        assert result.tokens == greedy, name
        if name == "oracle":
            assert result.drafted == result.accepted and result.target_calls > 1
    on_time = OnTimeAcceptanceHead(16, depth=0, candidate_embedding_size=16)
    assert decoder.decode_one(prompt, make_policy("head", 0.5, 4), 12, seed=0, head=on_time).tokens == greedy
    constant = decoder.decode_one(prompt, make_policy("constant_k", 4), 12, seed=0)
    assert constant.drafted > constant.accepted  # the constant policy does discard on this pair


# ---- the command on the tiny pair


def eval_args(head: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--head", str(head), "--data", str(data), "--out", str(out), "--num-decode-prompts", "4",
            "--max-new-tokens", "6", "--max-draft", "4", "--constant-ks", "[1,2,4]", "--head-thresholds", "[0.3,0.7]",
            "--sprinter-thresholds", "[0.3,0.6]", "--bootstrap", "20", "--progress", "false", *extra]


def test_eval_writes_the_report_with_the_tuned_rule_and_leaves_the_checkpoint_alone(trained, tmp_path, capsys):
    data, root = trained
    checkpoint = root / "specdecpp" / "checkpoints" / "last.ckpt"
    out = tmp_path / "report"
    checkpoint_bytes = checkpoint.read_bytes()
    assert main(eval_args(checkpoint, data, out, "--sv-companion-skip-layers", "[1]")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["offline"]) == {"head", "svip_entropy", "draft_top1", "draft_prob", "vllm_online", "adaedl", "sv_companion",
                                       "vllm_current", "vllm_margin", "head_online", "head_online_margin",
                                       "beta_oracle", "label_ceiling", "constant"}
    assert "margin_note" not in metrics["data"]  # gen stores `top2`: the top-2 margin is scored
    for name in ("auc", "pr_auc", "brier", "ece", "binary_kl", "auc_ci", "binary_kl_ci"):
        assert name in metrics["offline"]["head"]
    assert metrics["offline"]["adaedl"]["ece"] is not None  # AdaEDL's bound claims a probability: calibration scored
    decoding = metrics["decoding"]
    assert decoding["t_draft_over_t_target"] == 0.2
    assert 0 < decoding["sv_companion_cost"] <= 1  # the companion's forwards, in draft forwards, as counted
    assert {row["policy"] for row in decoding["policies"]} == {*BASELINES, "head", "oracle"}
    for row in decoding["policies"]:
        for name in ("threshold", "discard_rate", "verification_rate", "mean_accepted_length", "tokens_per_s",
                     "modelled_speedup"):
            assert isinstance(row[name], float), name
        runs = [r for r in json.loads((out / "runs.json").read_text())["runs"]
                if (r["policy"], r["threshold"], r["split"]) == (row["policy"], row["threshold"], "test")]
        emitted, forwards, calls = (sum(r[key] for r in runs) for key in ("emitted", "draft_forwards", "target_calls"))
        heads = sum(r["head_forwards"] for r in runs)  # each token the head scored, at the head's cost
        assert heads == pytest.approx(decoding["head_forward_cost"] * sum(r["head_scored"] for r in runs))
        assert (heads > 0) == (row["policy"] in ("head", "head_cost"))
        assert row["modelled_speedup"] == pytest.approx(emitted / (0.2 * (forwards + heads) + calls))
    assert all(row["discard_rate"] == 0 for row in decoding["policies"] if row["policy"] == "oracle")
    for plot in ("roc.png", "reliability.png", "pareto.png", "acceptance_lengths.png"):
        assert (out / plot).stat().st_size > 1000 and plot in (out / "report.html").read_text()
    assert "Verdict" in (out / "report.md").read_text()
    assert "| draft_prob | yes |" in (out / "report.md").read_text()  # which scores read the drawn token
    assert "| svip_entropy | no |" in (out / "report.md").read_text()
    assert "| sv_companion | yes |" in (out / "report.md").read_text()
    assert "| adaedl | no |" in (out / "report.md").read_text()  # H(q) is known before the draw
    assert "SV's companion forwards count as" in (out / "report.md").read_text()
    # the typed report round-trips: read back, it is what was written, and writing it again gives the same file
    report = read_report(out)
    assert report.as_dict() == metrics and Report.from_dict(report.as_dict(), "again") == report
    (tmp_path / "copy").mkdir()
    report.write(tmp_path / "copy")
    assert (tmp_path / "copy" / "metrics.json").read_text() == (out / "metrics.json").read_text()
    assert report.headline()["auc"] == metrics["offline"]["head"]["auc"] and report.decision_rule.tuned
    broken = {k: v for k, v in metrics.items() if k != "decision_rule"}
    with pytest.raises(UsageError, match="not a `specheads eval` report .*decision_rule"):
        Report.from_dict(broken, "broken.json")
    rule = metrics["decision_rule"]  # the tuned rule lives in the report; the checkpoint is left as it was
    assert rule["tuned"] and rule["threshold"] == decoding["tuned_thresholds"]["head"]
    assert checkpoint.read_bytes() == checkpoint_bytes and load_trained(str(checkpoint)).decision is None
    assert set(decoding["gain_intervals"]) == set(BASELINES)
    strongest = max(BASELINES, key=lambda b: metrics["verdict"]["decoding"][f"{b}_speedup"])
    assert metrics["verdict"]["decoding"]["strongest_baseline"] == strongest
    assert report.headline()["gain_vs_strongest_baseline"] == metrics["verdict"]["decoding"][f"gain_vs_{strongest}"]
    assert f"The strongest free rule on the test prompts is {strongest}" in (out / "report.md").read_text()
    assert decoding["tuned_at_grid_edge"] == grid_edges(decoding["dev_policies"], decoding["tuned_thresholds"])
    for policy in decoding["tuned_at_grid_edge"]:
        assert f"Warning: {policy}'s tuned threshold" in (out / "report.md").read_text()
    for baseline, ci in decoding["gain_intervals"].items():  # paired over test prompts: none from a single one
        gain = metrics["verdict"]["decoding"][f"gain_vs_{baseline}"]
        assert ci is None if decoding["prompts"]["test"] < 2 else ci[0] <= gain <= ci[1]
    assert "report:" in capsys.readouterr().out


def test_eval_of_a_sprinter_verifier_reports_operating_points(trained, tmp_path):
    data, root = trained
    out = tmp_path / "report"
    assert main(eval_args(root / "sprinter" / "checkpoints" / "last.ckpt", data, out)) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    sprinter = metrics["sprinter"]
    assert [p["tau"] for p in sprinter["operating_points"]] == [1.0, 1.2, 1.5]
    assert sprinter["threshold"] == metrics["decision_rule"]["threshold"] and 0 <= sprinter["tv_distance"] <= 1
    tuned = metrics["decoding"]["tuned_thresholds"].get("sprinter")  # tuned only within the distance budget
    if tuned is not None:
        assert sprinter["threshold"] == tuned and sprinter["tv_distance"] <= 0.05
    assert {row["policy"] for row in metrics["decoding"]["policies"]} == {"constant_k", "sprinter"}
    assert set(metrics["offline"]["label_ceiling"]) and metrics["offline"]["label_ceiling"]["auc"] == pytest.approx(1.0)
    caption = (out / "report.md").read_text()
    assert "0/1 outcomes, so it reaches 1 and bounds nothing" in caption and "no predictor reaches 1" not in caption


def test_eval_refuses_data_of_another_fingerprint(trained, tmp_path, capsys):
    data, root = trained
    head = load_trained(str(root / "specdecpp" / "checkpoints" / "last.ckpt"))
    manifest = json.loads((data / "manifest.json").read_text())
    other = json.loads(json.dumps(manifest))
    other["fingerprint"] = "0000000000000000"
    other["identity"]["sampling"]["temperature"] = 0.0
    with pytest.raises(UsageError, match=r"differs in sampling\.temperature"):
        check_data(head, other, "other-data", allow_other_data=True)
    other["identity"]["sampling"]["temperature"] = manifest["identity"]["sampling"]["temperature"]
    other["identity"]["seed"] = 7
    with pytest.raises(UsageError, match=r"differs in seed; pass --allow-other-data"):
        check_data(head, other, "other-data", allow_other_data=False)
    check_data(head, other, "other-data", allow_other_data=True)  # other prompts or seeds of the same models: allowed
    assert main(eval_args(tmp_path / "missing.ckpt", data, tmp_path / "r")) == 2
    assert "error" in capsys.readouterr().err and not (tmp_path / "r").exists()


UNSEEN = ["Plan a picnic for four friends.", "List two prime numbers above ten.", "Describe a quiet morning.",
          "Translate 'good night' into French.", "Write a haiku about rain.", "Explain what a compiler does.",
          "Give a tip for learning to swim.", "Name a planet with rings.", "Suggest a title for a mystery novel.",
          "Convert 3 kilometres to metres.", "Why do leaves change colour?", "Recommend a board game for kids."]


def test_other_data_is_held_out_by_the_prompts_the_head_trained_on(trained, tiny_model, prompts_file, tmp_path):
    """12 prompts the head never saw, plus two of its training prompts under new ids: evaluated with
    --allow-other-data, all 12 are held out offline and decoded, and the two are recognised by their tokens."""
    data, root = trained
    checkpoint = root / "specdecpp" / "checkpoints" / "last.ckpt"
    split = json.loads((root / "specdecpp" / "split.json").read_text())
    original = {json.loads(line)["id"]: json.loads(line) for line in prompts_file.read_text().splitlines()}
    trained_ids = split["train"]["prompt_ids"][:2]
    assert load_trained(str(checkpoint)).used_prompts == set(split["train"]["prompt_digests"])
    records = [{"id": f"new{i}", "prompt": text} for i, text in enumerate(UNSEEN)]
    records += [{**original[prompt_id], "id": f"renamed-{prompt_id}"} for prompt_id in trained_ids]
    other_prompts = tmp_path / "other.jsonl"
    other_prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    other = tmp_path / "other-data"
    assert main(tiny_args(tiny_model, other_prompts, other, "--mixing.schedule", "[0.15, 1.0]")) == 0
    out = tmp_path / "report"
    args = eval_args(checkpoint, other, out, "--allow-other-data", "true")
    args[args.index("--num-decode-prompts") + 1] = "14"
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data"]["prompts"] == 12 and metrics["data"]["prompts_trained_on"] == 2
    decoding = metrics["decoding"]
    assert decoding["prompts"] == {"dev": 6, "test": 6} and decoding["prompts_dropped_as_seen_in_training"] == 2
    decoded = {run["prompt_id"] for run in json.loads((out / "runs.json").read_text())["runs"]}
    assert decoded == {f"new{i}" for i in range(12)}
    # on its own data: the validation prompts, less those whose tokens equal a training prompt's (the fixture's
    # prompts repeat texts under other ids, as text and as a chat message, which the chat template makes equal)
    rows = load_labelled(str(data))
    trained_digests = set(split["train"]["prompt_digests"])
    unseen = {prompt_id for prompt_id, ids in zip(rows["prompt_id"], rows["prompt_ids"])
              if prompt_id in split["val"]["prompt_ids"] and prompt_digest(ids) not in trained_digests}
    assert 0 < len(unseen) < len(split["val"]["prompt_ids"])
    own = tmp_path / "own"
    assert main(eval_args(checkpoint, data, own, "--num-decode-prompts", "0")) == 0
    assert json.loads((own / "metrics.json").read_text())["data"]["prompts"] == len(unseen)
    # a head that does not record its training prompts cannot be held out on other data: refused, nothing written
    older = torch.load(checkpoint, weights_only=True)
    del older["hyper_parameters"]["data_split"]["train_prompts"]
    torch.save(older, tmp_path / "older.ckpt")
    refused = eval_args(tmp_path / "older.ckpt", other, tmp_path / "older-report", "--allow-other-data", "true")
    assert main(refused) == 2 and not (tmp_path / "older-report").exists()


def test_decoding_device_and_signal_grid_options(trained, tmp_path, capsys):
    from specheads.eval.run import decoding_device
    from specheads.eval.sweep import signal_thresholds

    assert decoding_device("cpu") == torch.device("cpu")
    assert decoding_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError, match="unknown device 'tpu9'"):
        decoding_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no GPU"):
            decoding_device("cuda")
    entropy, prob = np.linspace(0, 4, 101), np.linspace(0, 1, 101)
    grid = signal_thresholds(entropy, prob, [0.25, 0.5])
    assert grid["confidence"] == [0.25, 0.5] and grid["svip"] == pytest.approx([np.sqrt(3.0), np.sqrt(2.0)], abs=1e-4)
    data, root = trained  # a bad device is refused before anything is loaded or written
    assert main(eval_args(root / "specdecpp", data, tmp_path / "r", "--device", "tpu9")) == 2
    assert "unknown device" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_eval_reuses_head_free_runs_of_an_earlier_report_in_the_same_context(trained, tmp_path, capsys):
    data, root = trained
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(eval_args(head, data, first)) == 0
    assert main(eval_args(head, data, second, "--reuse-runs", str(first))) == 0
    before = {(r["policy"], r["threshold"], r["prompt_id"]): r for r in json.loads((first / "runs.json").read_text())["runs"]}
    after = json.loads((second / "runs.json").read_text())
    head_free = [r for r in after["runs"] if r["policy"] in ("constant_k", "svip", "confidence", "pmin")]
    assert head_free and all(r["reused"] for r in head_free)
    for run in after["runs"]:
        earlier = before[(run["policy"], run["threshold"], run["prompt_id"])]
        assert (run["emitted"], run["drafted"], run["accepted"]) == (earlier["emitted"], earlier["drafted"], earlier["accepted"])
        # wall times never repeat exactly: equal seconds means the run was taken, not decoded again; the rules that
        # adapt at run time depend on the runs decoded before them, so they are decoded again (the same tokens here)
        assert (run["seconds"] == earlier["seconds"]) == (run["policy"] not in ("head", *ONLINE_POLICIES))
    metrics = json.loads((second / "metrics.json").read_text())
    assert metrics["decoding"]["reused_runs"] == {"from": str(first), "count": len(head_free)}
    assert f"{len(head_free)} head-free runs were taken from" in (second / "report.md").read_text()
    assert after["context"]["max_new_tokens"] == 6
    assert len(after["context"]["prompts"]) == sum(metrics["decoding"]["prompts"].values())

    other = eval_args(head, data, tmp_path / "other", "--reuse-runs", str(first))
    other[other.index("--max-new-tokens") + 1] = "5"
    assert main(other) == 2
    assert "another max_new_tokens" in capsys.readouterr().err and not (tmp_path / "other").exists()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "runs.json").write_text(json.dumps({"runs": list(before.values())}))
    assert main(eval_args(head, data, tmp_path / "r", "--reuse-runs", str(legacy))) == 2
    assert "does not record its decoding context" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_eval_confirms_an_earlier_tuning_on_fresh_prompts_only(trained, tmp_path, capsys):
    data, root = trained
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    tuning = tmp_path / "tuning"
    assert main(eval_args(head, data, tuning)) == 0
    earlier = json.loads((tuning / "metrics.json").read_text())["decoding"]
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_text("".join(json.dumps({"id": f"fresh{i}", "prompt": text}) + "\n"
                             for i, text in enumerate(["Draft a note to the team.", "Name three colours.", "Add 7 and 5."])))
    confirm = ["eval", "--head", str(head), "--data", str(data), "--out", str(tmp_path / "confirm"), "--decode-prompts",
               str(fresh), "--num-decode-prompts", "3", "--max-new-tokens", "6", "--max-draft", "4", "--bootstrap", "20",
               "--progress", "false", "--tuned-from", str(tuning)]
    assert main(confirm) == 0
    metrics = json.loads((tmp_path / "confirm" / "metrics.json").read_text())
    decoding = metrics["decoding"]
    assert decoding["prompts"] == {"dev": 0, "test": 3} and decoding["dev_policies"] == []
    assert decoding["tuned_thresholds"] == earlier["tuned_thresholds"]
    assert decoding["tuned_from"] == {"report": str(tuning), "dev_prompts": earlier["prompts"]["dev"]}
    # each policy ran at its earlier tuned threshold only (the oracle is read off constant K_max), on every fresh prompt
    runs = json.loads((tmp_path / "confirm" / "runs.json").read_text())["runs"]
    assert {(r["policy"], r["threshold"]) for r in runs} == set(earlier["tuned_thresholds"].items()) | {("constant_k", 4.0)}
    assert {r["prompt_id"] for r in runs} == {"fresh0", "fresh1", "fresh2"} and {r["split"] for r in runs} == {"test"}
    assert all(row["tuned"] for row in decoding["policies"])
    assert set(decoding["gain_intervals"]) == set(BASELINES) - {"sv_companion"}  # no companion given
    assert metrics["decision_rule"]["threshold"] == earlier["tuned_thresholds"]["head"]
    assert f"dev prompts of `{tuning}`" in (tmp_path / "confirm" / "report.md").read_text()
    capsys.readouterr()

    def refused(args: list[str], reason: str) -> None:
        out = Path(args[args.index("--out") + 1])
        assert main(args) == 2
        assert reason in capsys.readouterr().err and not out.exists()

    on_dev = eval_args(head, data, tmp_path / "on-dev")[:-2] + ["--tuned-from", str(tuning)]
    on_dev = [a for a in on_dev if a not in ("--constant-ks", "[1,2,4]", "--head-thresholds", "[0.3,0.7]",
                                             "--sprinter-thresholds", "[0.3,0.6]")]
    refused(on_dev, "tuned the thresholds of")  # the earlier report's own prompts include its dev half
    refused(confirm[:confirm.index("--out") + 1] + [str(tmp_path / "grid")] + confirm[confirm.index("--out") + 2:]
            + ["--head-thresholds", "[0.5]"], "drop --head-thresholds")
    other_head = [str(root / "sprinter" / "checkpoints" / "last.ckpt") if a == str(head) else a for a in confirm]
    other_head[other_head.index("--out") + 1] = str(tmp_path / "other-head")
    refused(other_head, "for another head (differs in weights_digest, config, reads")
    longer = [a if a != "6" else "7" for a in confirm]
    longer[longer.index("--out") + 1] = str(tmp_path / "longer")
    refused(longer, "tuned with another max_new_tokens")
    # a report from before the head's forwards were counted tuned its thresholds with the head free
    free = tmp_path / "free"
    shutil.copytree(tuning, free)
    saved = json.loads((free / "runs.json").read_text())
    assert saved["context"].pop("head_forward_cost") > 0
    (free / "runs.json").write_text(json.dumps(saved))
    from_free = [str(free) if a == str(tuning) else a for a in confirm]
    from_free[from_free.index("--out") + 1] = str(tmp_path / "from-free")
    refused(from_free, "tuned with another head forward cost")


def test_eval_decodes_fixed_thresholds_with_every_prompt_a_test_prompt(trained, tmp_path, capsys):
    data, root = trained
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    fixed = {"constant_k": 2, "confidence": 0.3, "head": 0.55}
    args = ["eval", "--head", str(head), "--data", str(data), "--out", str(tmp_path / "fixed"), "--num-decode-prompts",
            "3", "--max-new-tokens", "6", "--max-draft", "4", "--bootstrap", "20", "--progress", "false",
            "--fixed-thresholds", json.dumps(fixed), "--serving-batch-sizes", "[2]", "--serving-batch-policies",
            "[smartspec]", "--prompt-cache-mb", "64"]
    assert main(args) == 0
    metrics = json.loads((tmp_path / "fixed" / "metrics.json").read_text())
    decoding = metrics["decoding"]
    assert decoding["prompts"] == {"dev": 0, "test": 3} and decoding["tuned_thresholds"] == fixed
    runs = json.loads((tmp_path / "fixed" / "runs.json").read_text())["runs"]
    assert {(r["policy"], r["threshold"]) for r in runs} == set(fixed.items()) and {r["split"] for r in runs} == {"test"}
    # a threshold tuned for another head is not this head's tuned rule
    assert metrics["decision_rule"]["threshold"] == 0.55 and not metrics["decision_rule"]["tuned"]
    assert "given in the config" in (tmp_path / "fixed" / "report.md").read_text()
    assert {r["policy"] for r in decoding["serving"]["rows"] if r["decoded"] == "live"} == {"smartspec"}
    capsys.readouterr()
    for extra, reason in ((["--fixed-thresholds", '{"bogus": 1}'], "names unknown policies bogus"),
                          (["--head-thresholds", "[0.5]"], "drop --head-thresholds"),
                          (["--fixed-thresholds", '{"constant_k": 2, "sprinter": 0.5}'], "names sprinter, which the eval"),
                          (["--fixed-thresholds", '{"constant_k": 2}'], "no threshold for `head`"),
                          (["--fixed-thresholds", '{"head": 0.5, "oracle": 3}'], "give oracle: 4"),
                          (["--tuned-from", str(tmp_path / "fixed")], "give one")):
        out = tmp_path / "refused"
        assert main(args[: args.index("--out") + 1] + [str(out)] + args[args.index("--out") + 2:] + extra) == 2
        assert reason in capsys.readouterr().err and not out.exists()


def test_an_earlier_tuning_is_matched_to_its_head_by_weights_then_source_and_config():
    from specheads.eval.tuned import head_differences

    head = {"source": "a.ckpt", "weights_digest": "d1", "reads": "candidate_state", "data_fingerprint": "f",
            "config": {"depth": 3, "state_layer": None}}
    older_report = {k: v for k, v in head.items() if k != "weights_digest"} | {"config": {"depth": 3}}
    assert head_differences(older_report, head) == []  # no digest recorded: the source decides; unset fields match
    assert head_differences(older_report | {"source": "b.ckpt"}, head) == ["source"]
    assert head_differences(head | {"weights_digest": "d2", "source": "b.ckpt"}, head) == ["weights_digest"]
    assert head_differences(head | {"config": {"depth": 3, "state_layer": 20}}, head) == ["config"]


@pytest.mark.parametrize("flags, fragment", [
    (["--cost-ratio", "1"], "--cost-ratio: 1 is not a OpenUnitInterval (v>0 and v<1)"),
    (["--constant-ks", "[0,2]"], "--constant-ks: 0 is not a PositiveInt"),
    (["--head-thresholds", "[0.5,1.5]"], "--head-thresholds: 1.5 is not a ClosedUnitInterval"),
    (["--stop-shares", "[0.0]"], "--stop-shares: 0.0 is not a OpenUnitInterval"),
    (["--num-decode-prompts", "1"], "num_decode_prompts must be 0 (no decoding runs) or at least 2"),
])
def test_eval_refuses_values_outside_their_typed_range_in_one_line(flags, fragment, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["eval", "--head", "h", "--data", "d", "--out", str(out), *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert fragment in error and len(error.splitlines()) == 1 and not out.exists()
