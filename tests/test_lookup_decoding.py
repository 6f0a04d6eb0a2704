"""Free drafts in the round engine: prompt lookup and suffix drafts sample exactly the target's distribution (chi-square,
B = 1 and batched, a rule reading later proposed tokens included), reproduce greedy decoding token for token, cost no
draft forward; and the free rules choose what they say."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_eval import chi_square_p, sequence_probabilities
from transformers import LlamaConfig, LlamaForCausalLM

import specheads.decoding.sampler as sampler
from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.free_draft import LookupCache, LookupDraft
from specheads.decoding.free_replay import SUFFIX_PLAN_DRAFT
from specheads.decoding.free_rules import (
    TABLE_HALF_LIFE,
    EstimatorPlanned,
    OnlineEstimatorPlanned,
    conditional_scores,
    goodput_length,
    length_bucket,
    linear_cost,
)
from specheads.decoding.online import Outcome
from specheads.decoding.rules import StopPolicy
from specheads.lookup.proposers import Proposal, suffix_available
from specheads.model_outputs.sampling import SamplingTransform

VOCAB, LENGTH = 3, 3
PROMPT = [0, 1, 2, 0, 1, 2, 0, 1]  # repeats itself: prompt lookup proposes from the first round on
SUFFIX = pytest.mark.skipif(not suffix_available(), reason="arctic-inference is not installed (sh scripts/install.sh "
                                                           "test builds it)")


@pytest.fixture(scope="module")
def target():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3,
                         tie_word_embeddings=False)
    torch.manual_seed(5)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def exact(target):
    """The target's distribution of LENGTH tokens after PROMPT at T = 1, by enumeration."""
    return sequence_probabilities(target, SamplingTransform(1.0), LENGTH, PROMPT, VOCAB)


class ReadsLaterTokens(StopPolicy):
    """Verifies one token when the proposal's last token is 0, all of it otherwise: a choice that reads proposed tokens
    after the first, which a free draft allows (each is a function of the verified context)."""

    def proposal_length(self, proposal, estimates):
        return 1 if proposal.tokens[-1] == 0 else len(proposal.tokens)


def sample(target, kind: str, rule, batch: int, runs: int = 800, first_seed: int = 0):
    """`runs` samples of LENGTH tokens under `rule`, decoded `batch` rows at a time (continuous batching)."""
    draft = LookupDraft("suffix", **SUFFIX_PLAN_DRAFT) if kind == "suffix_further" else LookupDraft(kind=kind)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    results = engine.decode([PROMPT] * runs, rule, LENGTH, list(range(first_seed, first_seed + runs)), batch_size=batch)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    assert drafted > runs and 0 < accepted < drafted  # proposals were made, some accepted, some rejected
    assert all(r.draft_forwards == 0 for r in results)  # a free draft runs no forward
    return [tuple(r.tokens) for r in results]


class Halves:
    """An estimator that rates every proposed token 0.5 (the online shift moves it)."""

    def estimates(self, proposal):
        return [0.5] * len(proposal.tokens)


RULES = {"constant_k": lambda: make_policy("constant_k", 3), "reads_later": lambda: ReadsLaterTokens(threshold=1.0),
         "lookup_table": lambda: make_policy("lookup_table", 0.3),  # a verify cost that makes its lengths vary
         "lookup_plan_online": lambda: OnlineEstimatorPlanned(threshold=0.3, estimator=Halves(), rate=0.3, half_life=4)}


CASES = [("ngram", 1, "constant_k"), ("ngram", 100, "reads_later"), ("ngram", 100, "lookup_table"),
         ("ngram", 100, "lookup_plan_online"),
         pytest.param("suffix", 100, "constant_k", marks=SUFFIX), pytest.param("suffix", 1, "reads_later", marks=SUFFIX),
         pytest.param("suffix", 100, "lookup_plan_online", marks=SUFFIX),  # suffix_plan: the planner on suffix drafts
         pytest.param("suffix_further", 100, "lookup_table", marks=SUFFIX)]  # suffix_table: read further, the table


@pytest.mark.parametrize(("kind", "batch", "rule"), CASES)
def test_free_drafts_sample_the_target_distribution(target, exact, kind, batch, rule):
    first_seed = 1000 * CASES.index(next(c for c in CASES if tuple(getattr(c, "values", c)) == (kind, batch, rule)))
    runs = 300 if batch == 1 else 800  # B = 1 decodes a request at a time: 300 still give p = 2e-16 with residual p
    p_value = chi_square_p(sample(target, kind, RULES[rule](), batch, runs, first_seed), exact)
    print(f"{kind} B={batch} {rule}: p = {p_value:.3g}")
    assert p_value > 1e-3


def test_the_chi_square_test_catches_a_wrong_residual_and_a_wrong_q(target, exact, monkeypatch):
    """The test has power: resampling a rejection from p itself (not p without the proposed token), or testing the
    proposed token against a q that is not its point mass (its frequency score read as q), is detected. (Suffix
    drafts propose the same tokens on this prompt and fail the same way.) On 400 sequences: p = 1e-18 and 6e-99 when
    this was written; every sampling case above fails with residual p too (B = 1 on 300: p = 2e-16, 8e-14)."""
    kind = "ngram"
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "residual", lambda probs, proposal: probs)
        p_value = chi_square_p(sample(target, kind, make_policy("constant_k", 3), 100, 400), exact)
        print(f"{kind}, residual p: p = {p_value:.3g}")
        assert p_value < 1e-6
    feed = LookupCache.feed

    def half_sure(self, tokens, logits_rows=None):  # q(x) = 1/2, the rest spread; the proposed token still drafted
        out = feed(self, tokens, logits_rows)
        return {row: (torch.where(torch.isinf(logits), torch.log(torch.tensor(0.5 / (VOCAB - 1))), torch.log(
            torch.tensor(0.5))), states) for row, (logits, states) in out.items()}

    with monkeypatch.context() as patch:
        patch.setattr(LookupCache, "feed", half_sure)
        patch.setattr("specheads.decoding.engine.draw", lambda log_probs, generator: int(log_probs.argmax()))
        p_value = chi_square_p(sample(target, kind, make_policy("constant_k", 3), 100, 400), exact)
        print(f"{kind}, q(x) = 1/2: p = {p_value:.3g}")
        assert p_value < 1e-6


def greedy_reference(target, prompt: list[int], new: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            tokens.append(int(target(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("kind", ["ngram", pytest.param("suffix", marks=SUFFIX)])
def test_greedy_free_drafts_reproduce_the_target_token_for_token(target, kind):
    prompts = [PROMPT, [2, 2, 1, 2, 2, 1, 2], [1, 1, 2, 1, 1, 2, 1]]
    expected = [greedy_reference(target, prompt, 24) for prompt in prompts]
    rules = {"constant_k": 4, "lookup_match": 1.0, "suffix_own": 0.1, "lookup_table": 0.043, "lookup_scores": 0.043}
    for (name, threshold), batch in itertools.product(rules.items(), (1, 3)):
        engine = RoundEngine(target, LookupDraft(kind=kind), SamplingTransform(0.0), stop_ids=[])
        results = engine.decode(prompts, make_policy(name, threshold, max_draft=6), 24, [0, 1, 2], batch_size=batch)
        assert [r.tokens for r in results] == expected, (name, batch)
        assert sum(r.accepted for r in results) > 0 and sum(r.draft_forwards for r in results) == 0


def proposal(tokens=(5, 6, 7), match_length=3, scores=(0.9, 0.5, 0.5), source="prompt") -> Proposal:
    return Proposal(tokens=tuple(tokens), match_length=match_length, match_count=2, distance=4, scores=tuple(scores),
                    source=source)


def test_the_free_rules_choose_what_they_say():
    assert make_policy("lookup_match", 1.0).proposal_length(proposal(match_length=2), None) == 2
    assert make_policy("lookup_match", 0.5).proposal_length(proposal(match_length=1), None) == 1
    assert make_policy("suffix_own", 0.6).proposal_length(proposal(), None) == 1  # 0.5 < 0.6 ends it
    assert make_policy("suffix_own", 0.1).proposal_length(proposal(match_length=2), None) == 2  # factor 1 · 2
    assert conditional_scores([0.9, 0.45, 0.0, 0.0]) == pytest.approx([0.9, 0.5, 0.0, 0.0])
    for estimates in ([0.9, 0.8, 0.1], [0.2, 0.9], [1.0, 1.0, 1.0, 1.0], []):
        for token_cost in (0.0, 0.05, 0.5, 2.0):
            cost = linear_cost(token_cost)
            values = [(1 + sum(np.prod(estimates[: j + 1]) for j in range(k))) / cost(k + 1)
                      for k in range(len(estimates) + 1)]
            assert goodput_length(estimates, cost) == int(np.argmax(values))
    assert goodput_length([0.1, 0.1], linear_cost(0.5)) == 0  # verifying nothing pays best: a plain target step


def test_vllm_table_buckets_counts_verified_positions_and_halves():
    assert [length_bucket(n) for n in (1, 6, 7, 10, 11, 20, 21, 90)] == [0, 5, 6, 6, 7, 7, 8, 8]
    planner = make_policy("lookup_table", 0.043).planner(None)
    planner.admit(0)
    seen = proposal(match_length=8)
    assert planner.estimates(0, seen) == [0.5, 0.5, 0.5]
    for _ in range(TABLE_HALF_LIFE - 1):
        planner.plan(0, seen, 3)
        planner.observe({0: [Outcome(1, 1.0, True), Outcome(2, 1.0, False)]})  # position 3 was never checked
    assert planner.counts[("prompt", 6, 0)] == [1023, 1023] and planner.counts[("prompt", 6, 1)] == [0, 1023]
    assert ("prompt", 6, 2) not in planner.counts
    assert planner.estimates(0, seen) == pytest.approx([1024 / 1025, 1 / 1025, 0.5])
    assert planner.estimates(0, proposal(match_length=8, source="output")) == [0.5, 0.5, 0.5]  # another source
    planner.plan(0, seen, 3)
    planner.observe({0: [Outcome(1, 1.0, True), Outcome(2, 1.0, True), Outcome(3, 1.0, True)]})  # step 1024: halved
    assert planner.counts[("prompt", 6, 0)] == [512, 512] and planner.counts[("prompt", 6, 2)] == [0, 0]


def test_an_estimator_plans_the_verify_and_a_free_draft_refuses_what_it_cannot_do(target):
    class Sure:
        def estimates(self, proposal):
            return [0.99] * len(proposal.tokens)

    class Doubtful(Sure):
        def estimates(self, proposal):
            return [0.01] * len(proposal.tokens)

    engine = RoundEngine(target, LookupDraft(), SamplingTransform(0.0), stop_ids=[])
    sure = engine.decode_one(PROMPT, EstimatorPlanned(threshold=0.05, estimator=Sure()), 12, 0)
    doubtful = engine.decode_one(PROMPT, EstimatorPlanned(threshold=0.05, estimator=Doubtful()), 12, 0)
    assert sure.drafted > 0 and doubtful.drafted == 0  # a doubtful proposal is not verified: plain target steps
    assert sure.tokens == doubtful.tokens == greedy_reference(target, PROMPT, 12)
    from specheads.plumbing.errors import UsageError

    with pytest.raises(UsageError, match="estimator="):
        engine.decode_one(PROMPT, make_policy("lookup_plan", 0.05), 4, 0)
    with pytest.raises(UsageError, match="free draft"):
        engine.decode_one(PROMPT, make_policy("oracle", 3), 4, 0)


def test_the_online_shift_moves_a_heads_estimates_toward_what_the_decode_verified():
    """lookup_plan_online: rejections at the first position pull every estimate down, acceptances push them up, and
    a position never verified moves nothing; rate 0 leaves the head's estimates as they are."""
    rule = OnlineEstimatorPlanned(threshold=0.05, estimator=Halves(), rate=0.5)
    planner = rule.planner(None)
    seen = proposal(match_length=3)

    def round_with(*accepted):
        planner.proposal_length(0, seen, rule)
        planner.plan(0, seen, len(accepted))
        planner.observe({0: [Outcome(k + 1, 1.0, ok) for k, ok in enumerate(accepted)]})
        return planner.estimates(0, seen)[0]

    assert planner.estimates(0, seen) == [0.5, 0.5, 0.5]
    lowered = round_with(False)
    shift = planner.shift
    planner.proposal_length(0, seen, rule)  # a round planned: the shift decays by its half-life
    assert planner.shift == pytest.approx(shift * 0.5 ** (1 / rule.half_life))
    assert lowered < 0.5 and round_with(False) < lowered
    assert round_with(True, True, True) > round_with(False)
    planner.plan(0, seen, 2)
    before = planner.shift
    planner.observe({1: [Outcome(1, 1.0, True)]})  # a row it planned nothing for
    assert planner.shift == before
    still = OnlineEstimatorPlanned(threshold=0.05, estimator=Halves(), rate=0.0).planner(None)
    still.proposal_length(0, seen, rule)
    still.plan(0, seen, 1)
    still.observe({0: [Outcome(1, 1.0, False)]})
    assert still.estimates(0, seen) == [0.5, 0.5, 0.5]
