"""SV's companion predictor (eval.companion): its signals equal their definitions on a tiny pair, and its equal-count
bins predict each cell's mean acceptance of the profiling set."""

import datasets
import numpy as np
import pytest
import torch
from test_eval import tiny_lm

from specheads.decoding.companion import equal_count_edges, profile
from specheads.eval.companion import companion_signals
from specheads.model_outputs.sampling import SamplingTransform


def test_signals_are_the_agreement_and_the_companion_acceptance_of_the_drafted_token():
    draft, companion = tiny_lm(seed=5, vocab=12), tiny_lm(seed=6, vocab=12)
    transform = SamplingTransform(0.8)
    rows = datasets.Dataset.from_dict({"prompt_ids": [[1, 2], [3, 4, 5, 6]], "target_ids": [[7, 8, 9], [1]],
                                       "draft_ids": [[7, 0, 9], [11]]})
    signals = companion_signals(draft, companion, transform, rows, batch=2)  # padded together
    for row, (s, a) in zip(rows, signals):
        ids = torch.tensor([row["prompt_ids"] + row["target_ids"]])
        q = transform.log_probs(draft(ids).logits[0]).exp()
        c = transform.log_probs(companion(ids).logits[0]).exp()
        for j, token in enumerate(row["draft_ids"]):
            step = len(row["prompt_ids"]) - 1 + j  # conditioned on the prompt and the target's tokens before j
            assert s[j] == pytest.approx(float(torch.minimum(q[step], c[step]).sum()), abs=1e-5)
            assert a[j] == pytest.approx(min(1.0, float(c[step, token] / q[step, token])), abs=1e-5)


def test_equal_count_bins_predict_each_cells_mean_acceptance():
    rng = np.random.default_rng(0)
    s, a = rng.uniform(size=4000), rng.uniform(size=4000)
    accept = np.clip(0.2 + 0.5 * s + 0.3 * a + rng.normal(0, 0.05, 4000), 0, 1)
    table = profile(s, a, accept, s_bins=10, a_bins=5)
    assert len(table.s_edges) == 9 and len(table.a_edges) == 4
    counts = np.histogram(s, bins=[0, *table.s_edges, 1])[0]
    assert counts.min() > 0.9 * 400  # equal-count bins
    inside = (s < table.s_edges[0]) & (a < table.a_edges[0])
    assert table.predict(np.array([0.0]), np.array([0.0]))[0] == pytest.approx(accept[inside].mean())
    assert np.corrcoef(table.predict(s, a), accept)[0, 1] > 0.9
    edges = equal_count_edges(np.array([0.5] * 50 + [0.9] * 50), 10)
    assert len(edges) == 3  # 9 quantiles of two tied values: 0.5, the midpoint, 0.9


def test_a_companion_forward_costs_the_weights_it_runs_beyond_the_prefix_it_shares_with_the_draft():
    """On a self-speculative pair a companion that keeps the draft's first layers branches from the draft's state: it
    pays its own later layers, final norm and output head; another model pays all of its weights but its embedding
    table; the draft itself nothing. The draft's weights read per token are its layers, final norm and output head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.decoding.companion import forward_cost
    from specheads.pair.models import without_layers

    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=8, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    layer = sum(p.numel() for p in target.model.layers[0].parameters())
    head = target.lm_head.weight.numel() + target.model.norm.weight.numel()  # what follows the layers
    draft = without_layers(target, [5, 6])  # layers 0-4, 7
    companion = without_layers(target, [6, 7])  # layers 0-5: shares 0-4 with the draft, runs layer 5 and its head
    assert forward_cost(companion, draft) == pytest.approx((layer + head) / (6 * layer + head))
    early = without_layers(target, [0])  # differs from the first layer on: all of its 7 layers
    assert forward_cost(early, draft) == pytest.approx((7 * layer + head) / (6 * layer + head))
    assert forward_cost(without_layers(target, [5, 6]), draft) == 0.0
    other = tiny_lm(seed=3, vocab=40)  # another model of 2 layers: no weight in common with the draft
    other_weights = sum(p.numel() for p in other.parameters()) - other.model.embed_tokens.weight.numel()
    if other.lm_head.weight is other.model.embed_tokens.weight:  # a tied head is read once, as the output head
        other_weights += other.lm_head.weight.numel()
    assert forward_cost(other, draft) == pytest.approx(other_weights / (6 * layer + head))


# ---- SV's companion predictor as a stop rule in the round engine

def test_a_companion_that_is_the_draft_agrees_at_every_step_so_the_rule_drafts_like_constant_k_max():
    """The companion's cache follows the draft's through rounds, rejections and refilled rows: a companion with the
    draft's weights gives c = q at every step (S = 1), which these bins score 1, so SV's rule never stops early and
    decodes exactly as constant K_max, with one companion forward beside each draft forward. Any step fed the wrong
    context gives S < 1 (beyond float32 rounding of the logits), scored 0, and the rule would stop there."""
    from test_batched import PROMPTS, VOCAB

    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.companion import BinTable, Companion

    target, draft = tiny_lm(seed=11, vocab=VOCAB, init=0.5).double(), tiny_lm(seed=12, vocab=VOCAB, init=0.5).double()
    twin = tiny_lm(seed=12, vocab=VOCAB, init=0.5).double()
    agree_only = BinTable(np.array([1 - 1e-5]), np.array([]), np.array([[0.0], [1.0]]))
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[5, 9], companion=Companion(twin, agree_only, 0.25))
    seeds = [100 + i for i in range(len(PROMPTS))]
    constant = engine.decode(PROMPTS, make_policy("constant_k", 4, max_draft=4), 14, seeds)
    for batch_size in (None, 2):  # all rows together, and two rows refilled from the queue
        sv = engine.decode(PROMPTS, make_policy("sv_companion", 0.5, max_draft=4), 14, seeds, batch_size=batch_size)
        assert [r.tokens for r in sv] == [r.tokens for r in constant]
        assert [r.companion_forwards for r in sv] == [r.draft_forwards for r in constant]
        assert [r.draft_forwards for r in sv] == [1.25 * r.draft_forwards for r in constant]  # companion at its cost
    pessimist = BinTable(np.array([]), np.array([]), np.array([[0.3]]))  # 1 − 0.3 > 0.5 after every candidate
    engine.companion = Companion(twin, pessimist)
    one = engine.decode(PROMPTS, make_policy("constant_k", 1, max_draft=4), 14, seeds)
    assert [r.tokens for r in engine.decode(PROMPTS, make_policy("sv_companion", 0.5, 4), 14, seeds)] == [r.tokens for r in one]


def test_the_companion_stop_rule_leaves_the_target_distribution_unchanged_and_needs_a_companion():
    from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities

    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.companion import Companion, profile
    from specheads.plumbing.errors import UsageError

    target, draft, companion = tiny_lm(seed=1), tiny_lm(seed=2), tiny_lm(seed=7)
    transform = SamplingTransform(1.0)
    rng = np.random.default_rng(0)
    s, a = rng.uniform(size=2000), rng.uniform(size=2000)
    bins = profile(s, a, np.clip(s * a + rng.normal(0, 0.1, 2000), 0, 1), s_bins=5, a_bins=5)  # stops vary with S, A
    engine = RoundEngine(target, draft, transform, stop_ids=[], companion=Companion(companion, bins))
    rule = make_policy("sv_companion", 0.3, max_draft=3)  # at 0.3 it stops at the first candidate in some first rounds
    results = [r for first in range(0, 500, 100)
               for r in engine.decode([PROMPT] * 100, rule, LENGTH, list(range(first, first + 100)))]
    assert chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform)) > 1e-3
    # the rule did stop early in some first rounds and not in others (there 2 is the cap: LENGTH − 1, the last slot
    # being the target's token)
    assert {r.drafted_per_round[0] for r in results} == {1, 2}
    with pytest.raises(UsageError, match="companion"):
        RoundEngine(target, draft, transform, stop_ids=[]).decode([PROMPT], rule, LENGTH, [0])
