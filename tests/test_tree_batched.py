"""Batched trees: several requests' trees verified in one target forward, with continuous batching; a row decodes what
it decodes alone, and the batch samples the target's distribution."""

from __future__ import annotations

import time

import pytest
import torch
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm
from test_tree import at_draft_head, greedy_setup

from specheads.decoding import BatchCache, RoundEngine
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

PROMPTS = [[0, 1, 2], [2, 2, 0, 1, 1, 1], [1], [1, 0, 2, 2], [0, 0, 1, 2, 0], [2, 1], [1, 0, 0]]


def counts(result) -> tuple:
    return (result.tokens, result.accepted_per_round, result.drafted_per_round, result.draft_forwards,
            result.target_calls, result.emitted)


@pytest.mark.parametrize(("values", "cost_ratio"), [("confidence", None), ("head", None), ("head", 0.2)])
def test_a_row_of_a_batched_tree_decodes_what_it_decodes_alone(values, cost_ratio):
    """float64, prompts of different lengths, a stop token that ends some requests early so that rows take new ones:
    at B = 3 every request's tokens and counts are those of B = 1."""
    target, draft = tiny_lm(seed=1).double(), tiny_lm(seed=2).double()
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[2])
    head = at_draft_head().double() if values == "head" else None
    rule = TreeRule(values, 0.1, 5, 3, 2, cost_ratio=cost_ratio)
    seeds = list(range(len(PROMPTS)))
    alone = decode_tree(engine, PROMPTS, rule, 12, seeds, head)
    together = decode_tree(engine, PROMPTS, rule, 12, seeds, head, batch_size=3)
    assert [counts(r) for r in together] == [counts(r) for r in alone]
    # each round's draft forwards, as the serving table prices them: the tail's, then each read of nodes
    assert all(sum(map(len, r.draft_widths_per_round)) == r.draft_forwards for r in alone)
    assert [r.draft_widths_per_round for r in together] == [r.draft_widths_per_round for r in alone]
    assert len({r.emitted for r in alone}) > 1  # some ended at the stop token: their rows took the next request
    assert any(size > 1 for r in alone for size in r.accepted_per_round)


def test_batched_trees_sample_the_target_distribution():
    """500 requests of PROMPT, 8 rows at a time: the sequences follow the target's exact distribution."""
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    transform = SamplingTransform(1.0)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    runs = 500
    results = decode_tree(engine, [PROMPT] * runs, TreeRule("confidence", 0.15, 5, 3, 2), LENGTH, list(range(runs)),
                          batch_size=8)
    assert chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform)) > 1e-3
    assert all(r.emitted == LENGTH for r in results) and len({s for r in results for s in r.drafted_per_round}) > 2


def test_batched_greedy_trees_decode_each_prompts_greedy_tokens():
    engine, prompt, _ = greedy_setup()
    prompts = [prompt, prompt[:2], prompt[1:] + [3], [5, 4]]
    expected = []
    with torch.no_grad():
        for start in prompts:
            tokens: list[int] = []
            for _ in range(10):
                tokens.append(int(engine.target(torch.tensor([start + tokens])).logits[0, -1].argmax()))
            expected.append(tokens)
    results = decode_tree(engine, prompts, TreeRule("confidence", floor=0.0, budget=6, width=2), 10, [0] * 4,
                          batch_size=2)
    assert [r.tokens for r in results] == expected


def test_one_forward_verifies_every_rows_tree_and_a_bad_batch_size_is_refused():
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    rule = TreeRule("confidence", 0.1, 4, 2, 2)
    alone = decode_tree(engine, PROMPTS[:4], rule, 8, [0, 1, 2, 3])
    start = time.perf_counter()
    together = decode_tree(engine, PROMPTS[:4], rule, 8, [0, 1, 2, 3], batch_size=4)
    wall = time.perf_counter() - start
    # B = 4 with four requests: the target's forwards are the longest request's rounds, each shared by its rows, and
    # the requests' shares of the wall time add up to the decode's (as the chain engine's do)
    assert sum(r.target_passes for r in alone) == sum(r.target_calls for r in alone)
    assert sum(r.target_passes for r in together) == pytest.approx(max(r.target_calls for r in together))
    assert 0.5 * wall < sum(r.seconds for r in together) <= wall
    assert all(r.target_seconds <= r.seconds for r in together)
    empty = decode_tree(engine, PROMPTS[:3], rule, 0, [0, 1, 2], batch_size=2)
    assert [(r.tokens, r.target_calls, r.draft_forwards) for r in empty] == [([], 0, 0)] * 3
    with pytest.raises(UsageError, match="empty"):
        decode_tree(engine, [[0, 1], []], rule, 4, [0, 1])
    with pytest.raises(UsageError, match="batch_size"):
        decode_tree(engine, PROMPTS[:2], rule, 8, [0, 1], batch_size=0)
    assert BatchCache(target, 2).plain_layers()


def test_a_batched_tree_forward_gives_each_rows_nodes_the_logits_of_their_own_paths():
    """Two rows holding different contexts, each fed a tree in one forward: every node's logits are a fresh forward
    over its row's context and its own path (no row sees the other's slots)."""
    target = tiny_lm(seed=1, vocab=12, init=1.0)
    cache = BatchCache(target, 2)
    cache.feed({0: [0, 1, 2], 1: [5, 4]})
    first = cache.mask.shape[1]
    out = cache.feed_trees({0: ([7, 8, 9], [3, 4, 4], [[], [first], [first]]),
                            1: ([3, 6], [2, 3], [[], [first]])})
    for row, context, paths in ((0, [0, 1, 2], [[7], [7, 8], [7, 9]]), (1, [5, 4], [[3], [3, 6]])):
        logits, _, slots = out[row]
        assert slots == list(range(first, first + len(paths)))
        for index, path in enumerate(paths):
            fresh = target(torch.tensor([context + path])).logits[0, -1].float()
            assert torch.allclose(logits[index], fresh, atol=1e-5), (row, path)
