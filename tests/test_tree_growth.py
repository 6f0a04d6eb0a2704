"""Trees whose growth weighs their costs (`TreeRule(cost_ratio=...)`): the rule read by hand, the trees it grows,
exactness under sampling, greedy identity, and the chain's cost rule as the tree of width 1."""

from __future__ import annotations

import math

import pytest
import torch
from test_eval import LENGTH, PROMPT, tiny_lm
from test_tree import at_draft_head, greedy_setup, sampled_trees

from specheads.decoding import BatchCache, RoundEngine, make_policy
from specheads.decoding.cost_rule import RequestState
from specheads.decoding.costs import CostCurve
from specheads.decoding.tree import TreeCosts, TreeDrafter, TreeRule, decode_tree
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

LINEAR = CostCurve((1, 2), (1.0, 1.1))  # each token adds a tenth of a one-token forward


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


def constant_draft(q: list[float]) -> torch.nn.Module:
    """A draft whose q is `q` after every context: every token embeds to the same vector and the layers add nothing,
    so the logits are log q."""
    model = tiny_lm(seed=0, vocab=len(q))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = torch.tensor(q).log()
    return model


def test_the_growth_rule_prices_a_read_against_c_and_a_slot_against_the_targets_curve():
    """By hand, at ρ = 1.5 and μ₁ = 0.6, μ₂ = 0.3 (μ₃ unknown: the mean of all, 0.5), c = 0.2: a read of a node of
    value v pays when v·0.6 > 1.5·0.2, i.e. v > 0.5; a slot is free on the flat curve and pays r·μ > 1.5·0.1 on a
    curve where each token adds 0.1."""
    flat = TreeCosts(0.2, None, RequestState(tokens=2.0, cost=1.0), {1: [1.2, 2], 2: [0.3, 1]})
    assert flat.request.rate() == 1.5 and flat.expected_score(3) == pytest.approx(0.5)
    assert flat.read_gain(0.51, nodes=3) == pytest.approx(0.006) and flat.read_gain(0.49, nodes=3) < 0
    assert flat.slot_gain(0.01, place=2, nodes=7) == pytest.approx(0.003)  # width is free up to the budget
    linear = TreeCosts(0.2, LINEAR, flat.request, flat.scores)
    assert linear.slot_gain(0.6, place=2, nodes=3) == pytest.approx(0.18 - 0.15)
    assert linear.slot_gain(0.4, place=2, nodes=3) < 0
    assert linear.read_gain(0.8, nodes=3) == pytest.approx(0.48 - 1.5 * 0.3)
    linear.observe(accepted=2, draft_forwards=3, nodes=4)  # 3 tokens for 0.6 + 1.4 target units
    assert linear.request.rate() == pytest.approx((1 + 5) / (1 + 3))
    fresh = TreeCosts(0.2)
    assert fresh.expected_score(1) == 1.0 and fresh.request.rate() == 1.0
    fresh.scored(2, 0.4)
    assert fresh.expected_score(1) == pytest.approx(0.4)


def test_a_node_the_head_scores_costs_c_times_h_more_in_the_growth_and_in_the_rate():
    """With the head's forward priced (h = 0.5; the sibling head's 1.0 at second children), each scored node costs c·h:
    at ρ = 1.5, c = 0.2, a slot pays when r·μ > 1.5·0.1 (0.3 for a second child), a read when v·0.6 > 1.5·0.3; the
    rate charges c per draft forward and per head forward."""
    priced = TreeCosts(0.2, None, RequestState(tokens=2.0, cost=1.0), {1: [1.2, 2], 2: [0.3, 1]}, head_cost=0.5,
                       sibling_cost=1.0)
    assert priced.slot_gain(0.5, place=1, nodes=3) == pytest.approx(0.3 - 0.15)
    assert priced.slot_gain(0.9, place=2, nodes=3) == pytest.approx(0.27 - 0.3)  # the sibling head's forward
    assert priced.slot_gain(0.9, place=3, nodes=3) == pytest.approx(0.45 - 0.15)
    assert priced.read_gain(0.8, nodes=3) == pytest.approx(0.48 - 0.45)
    priced.observe(accepted=2, draft_forwards=3, nodes=4, head_forwards=2.5)  # 3 tokens for 0.6 + 0.5 + 1
    assert priced.request.rate() == pytest.approx((1 + 5) / (1 + 3.1))
    assert TreeCosts(0.2).slot_gain(0.01, place=2, nodes=7) > 0  # confidence values: no head, width free


@pytest.mark.parametrize(("cost_ratio", "shape", "forwards"), [
    # worked by hand (docs/method.md): q = (0.7, 0.2, 0.1) everywhere, fixed children of scores 0.7 and 0.2/0.3
    (0.5, [(0, -1), (1, -1)], 1),  # reading the first child gains 0.7·0.7 − 0.5 < 0: one level, two wide
    (0.3, [(0, -1), (1, -1), (0, 0), (1, 0)], 2),  # the root's second slot (0.21) before the read (0.19), then A's
    (0.1, [(0, -1), (0, 0), (0, 1), (1, -1)], 3),  # the reads (0.39, 0.243) beat the root's second slot (0.21)
])
def test_the_tree_expands_and_stops_where_the_hand_computation_says(cost_ratio, shape, forwards):
    draft = constant_draft([0.7, 0.2, 0.1])
    engine = RoundEngine(draft, draft, SamplingTransform(1.0), stop_ids=[])
    cache = BatchCache(draft, 1)
    rule = TreeRule("confidence", 0.0, budget=4, width=2, expand=1, children="top", cost_ratio=cost_ratio)
    tree = TreeDrafter(engine, rule, None, torch.Generator().manual_seed(0)).grow(cache, [0, 1], depth_cap=4)
    assert [(n.token, n.parent) for n in tree.nodes] == shape
    assert cache.forwards[0] == forwards
    scores = {(n.token, n.parent): n.score for n in tree.nodes}
    assert (scores[0, -1], scores[1, -1]) == pytest.approx((0.7, 0.2 / 0.3), abs=1e-5)


@pytest.mark.parametrize(("values", "curve"), [("confidence", None), ("head", LINEAR)])
def test_cost_aware_trees_sample_the_target_distribution(tiny_pair, values, curve):
    """Trees grown by the costs (up to 3 children, 5 nodes), on the flat and on a linear target curve, decode the
    target's distribution; their shapes vary and later siblings are checked and stand."""
    results, checked, p_value = sampled_trees(tiny_pair, TreeRule(values, 0.0, 5, 3, 2, cost_ratio=0.3, curve=curve))
    assert p_value > 1e-3
    assert any(place > 1 and accepted for place, _, accepted in checked)
    assert len({size for r in results for size in r.drafted_per_round}) > 2
    assert all(r.emitted == LENGTH and r.target_calls == len(r.accepted_per_round) for r in results)


def test_a_greedy_cost_aware_tree_decodes_the_targets_greedy_tokens_and_c_shapes_it():
    """Greedy decoding with either value source and either curve: the target's argmax chain; a dearer draft forward
    grows shallower trees (fewer draft forwards per target call). The head's bias is raised: each node it scores
    costs c·h (h = 0.23 here), which a node it scores 0.006, as it does without, never pays for."""
    engine, prompt, expected = greedy_setup()
    confident = at_draft_head()
    with torch.no_grad():
        confident.out.bias.add_(2.0)
    for values, head in (("confidence", None), ("head", confident)):
        results = {}
        for cost_ratio, curve in ((0.05, None), (0.6, None), (0.2, LINEAR)):
            rule = TreeRule(values, 0.0, budget=6, width=2, cost_ratio=cost_ratio, curve=curve)
            results[cost_ratio] = decode_tree(engine, [prompt], rule, 16, [0], head)[0]
            assert results[cost_ratio].tokens == expected, (values, cost_ratio)
        assert max(results[0.05].accepted_per_round) > 1
        cheap, dear = (results[c].draft_forwards / results[c].target_calls for c in (0.05, 0.6))
        assert dear < cheap, (values, dear, cheap)


def test_the_cost_aware_tree_of_width_one_is_the_chains_rule_read_from_the_costs(tiny_pair):
    """Width 1: the tree reads a node when S_k·μ > ρ·(c + Δv), the head_cost chain's rule, token for token and count
    for count. (The chain's planner leaves a candidate at which its cap ends the round out of μ, the tree counts every
    scored child, so the caps here bind only in a request's last rounds.)"""
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head = at_draft_head()
    prompts, seeds = [PROMPT, [2, 2, 0, 1]] * 5, list(range(10))
    for cost_ratio in (0.15, 0.4):
        chain = [engine.decode_one(prompt, make_policy("head_cost", cost_ratio, max_draft=16), 12, seed, head)
                 for prompt, seed in zip(prompts, seeds)]
        tree = decode_tree(engine, prompts, TreeRule("head", 0.0, budget=16, width=1, cost_ratio=cost_ratio), 12, seeds,
                           head)
        for a, b in zip(chain, tree):
            assert (a.tokens, a.accepted_per_round, a.drafted_per_round, a.draft_forwards) == (
                b.tokens, b.accepted_per_round, b.drafted_per_round, b.draft_forwards)
        assert len({d for r in tree for d in r.drafted_per_round}) > 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cost_ratio": 1.5}, "cost_ratio is t_draft/t_target, in"),
    ({"cost_ratio": math.nan}, "cost_ratio is t_draft/t_target, in"),
    ({"curve": LINEAR}, "give cost_ratio too"),
    ({"cost_ratio": 0.2, "curve": {"tokens": [1, 2]}}, "must be a CostCurve"),
    ({"budget": "8"}, "budget must be a whole number"),
    ({"floor": None}, "floor must be a number"),
])
def test_bad_growth_settings_are_refused_in_one_line(kwargs, message):
    settings = {"values": "confidence", "floor": 0.0, "budget": 8, **kwargs}
    with pytest.raises(UsageError, match=message):
        TreeRule(**settings)
