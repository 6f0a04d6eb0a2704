"""benchmarks/lookup_replay.py: a greedy response decides every round of an exact prompt-lookup decode, so a rule's
counted cost can be replayed with no model forward; checked against rounds counted by hand and against the decoder."""

from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark, random_token_head
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.decoding import RoundEngine
from specheads.decoding.costs import CostCurve
from specheads.decoding.free_draft import LookupDraft
from specheads.decoding.free_replay import SUFFIX_PLAN_DRAFT
from specheads.lookup.planning import linear_cost
from specheads.lookup.proposers import ngram_propose, suffix_available
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

PRICE = linear_cost(0.1)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
RESPONSE = [1, 2, 3, 4, 9, 9, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def replay():
    return load_benchmark("lookup_replay")


@pytest.fixture(scope="module")
def target():
    """A tiny random target whose greedy output repeats itself (a few distinct tokens): lookup proposes often."""
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3)
    torch.manual_seed(5)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def rounds_by_hand(k: int) -> list[tuple[int, int]]:
    """(verified, accepted) of each round of constant K on RESPONSE, stepping as a decoder does."""
    start, found = 0, []
    while start < len(RESPONSE):
        room = len(RESPONSE) - start - 1  # the last token is the round's own (the decoder's bonus slot)
        tokens = ngram_propose(PROMPT + RESPONSE[:start], min(k, room), len(PROMPT)).tokens if room else ()
        accepted = 0
        while accepted < len(tokens) and start + accepted < len(RESPONSE) and tokens[accepted] == RESPONSE[start + accepted]:
            accepted += 1
        found.append((len(tokens), accepted))
        start += accepted + 1
    return found


@pytest.mark.parametrize("k", [1, 3, 8])
def test_constant_k_replay_prices_the_rounds_counted_by_hand(replay, k):
    policy, planner = replay.make_rule(f"constant_k:{k}", 32, None)
    cost, rounds = replay.replay(PROMPT, RESPONSE, policy, planner, 32, PRICE)
    by_hand = rounds_by_hand(k)
    assert rounds == len(by_hand) and cost == pytest.approx(sum(1 + 0.1 * verified for verified, _ in by_hand))


def test_the_oracle_verifies_only_what_is_accepted_and_no_rule_beats_it(replay):
    oracle = replay.replay(PROMPT, RESPONSE, *replay.make_rule("oracle", 32, None), 32, PRICE)
    # every verified token is accepted, so the tokens are the rounds' own plus the verified ones
    assert oracle[0] == pytest.approx(oracle[1] + 0.1 * (len(RESPONSE) - oracle[1]))
    for rule in ("constant_k:1", "constant_k:4", "constant_k:16", "lookup_table:0.1", "lookup_match:1.0"):
        assert replay.replay(PROMPT, RESPONSE, *replay.make_rule(rule, 32, None), 32, PRICE)[0] >= oracle[0] - 1e-9


def test_replay_counts_the_rounds_our_decoder_runs(replay, target):
    """At T = 0 the decoder's rounds on the target's own greedy output are the replay's: same target calls and
    drafted tokens (the tiny target's response, its prompt repeated so that lookup proposes)."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9]
    engine = RoundEngine(target, LookupDraft(), SamplingTransform(0.0), stop_ids=[])
    for rule in ("constant_k:4", "lookup_table:0.05"):
        policy, planner = replay.make_rule(rule, 8, None)
        result = engine.decode([prompt], policy, 24, [0], planner=planner)[0]
        counted, rounds = replay.replay(prompt, list(result.tokens), *replay.make_rule(rule, 8, None), 8, linear_cost(0.05))
        assert rounds == result.target_calls and result.drafted > 0
        assert counted == pytest.approx(rounds + 0.05 * result.drafted)


@pytest.mark.skipif(not suffix_available(), reason="suffix drafts need arctic-inference (sh scripts/install.sh test)")
def test_suffix_rules_replay_the_rounds_of_our_decoders_suffix_drafts(replay, target):
    """SuffixDecoding's own rule replays on its proposals, its global tree kept from one request to the next as the
    decoder keeps it: the same target calls and drafted tokens as the decoder's on each of two requests in turn; the
    oracle on those proposals costs no more, and prompt lookup's proposals would count other rounds."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9], [9, 10, 11, 5, 6, 7, 3, 9, 10, 11]]
    engine = RoundEngine(target, LookupDraft("suffix"), SamplingTransform(0.0), stop_ids=[])
    policy, _ = replay.make_rule("suffix_own:0.1", 8, None)
    results = [engine.decode([prompt], policy, 24, [0])[0] for prompt in prompts]
    responses = [(prompt, list(result.tokens)) for prompt, result in zip(prompts, results)]
    price = linear_cost(0.05)
    speedups = replay.replay_speedups(responses, ["suffix_own:0.1", "suffix_oracle", "constant_k:8"], None, 8)
    for index, ((_, response), result) in enumerate(zip(responses, results)):
        assert result.drafted > 0
        assert speedups["suffix_own:0.1"][index] == pytest.approx(
            len(response) / (result.target_calls + 0.043 * result.drafted))
        assert speedups["suffix_oracle"][index] >= speedups["suffix_own:0.1"][index] - 1e-9
    ngram = replay.replay(*responses[0], policy, None, 8, price)
    assert ngram[1] != results[0].target_calls  # the suffix tree's proposals, not prompt lookup's


@pytest.mark.skipif(not suffix_available(), reason="suffix drafts need arctic-inference (sh scripts/install.sh test)")
@pytest.mark.parametrize("rule", ["suffix_plan:0.043", "suffix_table:0.043"])
def test_the_rules_on_suffix_drafts_read_further_replay_the_decoders_rounds(replay, target, tmp_path, rule):
    """suffix_plan is the decoder's cost-read planner on SuffixDecoding's drafts read further, fed a head trained on
    suffix drafts, and suffix_table vLLM's table on the same drafts: the same target calls and drafted tokens as the
    decoder's; a head of prompt lookup's drafts refused."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9], [9, 10, 11, 5, 6, 7, 3, 9, 10, 11]]
    head = random_token_head(tmp_path / "suffix-head", "suffix", seed=3) if rule.startswith("suffix_plan") else None
    engine = RoundEngine(target, LookupDraft("suffix", **SUFFIX_PLAN_DRAFT), SamplingTransform(0.0), stop_ids=[])
    policy, planner = replay.make_rule(rule, 8, head)
    assert replay.reads_suffix(rule) and not replay.reads_suffix("lookup_plan:0.043")
    results = [engine.decode([prompt], policy, 24, [0], planner=planner)[0] for prompt in prompts]
    responses = [(prompt, list(result.tokens)) for prompt, result in zip(prompts, results)]
    speedups = replay.replay_speedups(responses, [rule], None, 8, suffix_head=head)[rule]
    for speedup, (_, response), result in zip(speedups, responses, results):
        assert speedup == pytest.approx(len(response) / (result.target_calls + 0.043 * result.drafted))
    assert sum(result.drafted for result in results) > 0
    if head is not None:
        with pytest.raises(UsageError, match="draft"):
            replay.make_rule(rule, 8, random_token_head(tmp_path / "lookup-head", "lookup"))


def test_bad_rules_are_refused_in_one_line(replay):
    with pytest.raises(UsageError, match="name:value"):
        replay.make_rule("constant_k", 32, None)
    with pytest.raises(UsageError, match="--head"):
        replay.make_rule("lookup_plan:0.043", 32, None)
    with pytest.raises(UsageError, match="--suffix-head"):
        replay.make_rule("suffix_plan:0.043", 32, None)


def test_planners_read_the_verify_curve(replay):
    """A curve where every verified token costs a whole forward leaves vLLM's table nothing worth verifying (its
    estimates stay below 1): every round is a plain target step; the linear CPU price lets it verify."""
    steep = CostCurve((1, 2, 40), (1.0, 2.0, 40.0))
    policy, planner = replay.make_rule("lookup_table:0.043", 32, None, steep)
    cost, rounds = replay.replay(PROMPT, RESPONSE * 3, policy, planner, 32, lambda n: steep(n) / steep(1))
    assert rounds == len(RESPONSE) * 3 and cost == rounds
    cheap = replay.replay(PROMPT, RESPONSE * 3, *replay.make_rule("lookup_table:0.043", 32, None), 32, PRICE)
    assert cheap[1] < len(RESPONSE) * 3


def test_compare_pairs_two_rules_prompt_by_prompt_and_refuses_others(replay):
    found = {"per_prompt": {"a": [2.0, 4.0, 1.0], "b": [1.0, 1.0, 2.0]}}
    row = replay.paired(found, ["a/b"])["a/b"]
    assert row["speedup"] == pytest.approx((2.0 * 4.0 * 0.5) ** (1 / 3)) and row["prompts"] == 3
    assert row["interval"][0] <= row["speedup"] <= row["interval"][1]
    with pytest.raises(UsageError, match="--compare"):
        replay.main(["--labels", "nowhere", "--prompts", "nowhere", "--rule", "constant_k:8", "--rule", "oracle",
                     "--compare", "constant_k:8/lookup_table:0.043"])
