"""Free drafts' proposals: prompt lookup token-identical to transformers' PromptLookupCandidateGenerator where the
rules agree, its match statistics counted by brute force, and SuffixDecoding's proposals through arctic-inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specheads.lookup.proposers import NO_PROPOSAL, SuffixProposer, copy_length, ngram_propose, suffix_available


def transformers_lookup(context: list[int], k: int, max_ngram: int) -> tuple[int, ...]:
    """transformers' own prompt lookup proposal after `context` (no eos, room to spare)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=max_ngram,
                                               max_length=len(context) + 1000)
    ids = torch.tensor([context])
    candidates, _ = generator.get_candidates(ids)
    return tuple(candidates[0, len(context):].tolist())


def random_contexts(count: int, seed: int = 0) -> list[list[int]]:
    """Contexts that repeat themselves (small vocabularies, copied spans), of every length from 2 on."""
    rng = np.random.default_rng(seed)
    contexts = []
    for _ in range(count):
        vocabulary = int(rng.integers(2, 12))
        base = rng.integers(0, vocabulary, int(rng.integers(2, 40))).tolist()
        if rng.random() < 0.5 and len(base) > 4:
            start = int(rng.integers(0, len(base) - 3))
            base += base[start : start + int(rng.integers(2, 6))]
        contexts.append(base)
    return contexts


@pytest.mark.parametrize("max_ngram", [1, 2, 3, 4])
def test_ngram_matches_transformers(max_ngram):
    """Token-identical to transformers' prompt lookup on 400 repetitive contexts, matches and misses alike."""
    matched = 0
    for context in random_contexts(400, seed=max_ngram):
        for k in (1, 3, 8):
            ours = ngram_propose(context, k, prompt_length=len(context), max_ngram=max_ngram)
            assert ours.tokens == transformers_lookup(context, k, max_ngram), (context, k)
            matched += bool(ours.tokens)
    assert matched > 300  # the contexts do repeat: most have a match


def test_ngram_statistics_by_brute_force():
    """match_length, match_count, distance, source and the agreement scores, counted the slow way."""
    context = [5, 1, 2, 3, 1, 2, 4, 9, 1, 2, 3, 7, 1, 2]
    proposal = ngram_propose(context, 4, prompt_length=6, max_ngram=3)
    # the last 3-gram (7, 1, 2) never occurred; the 2-gram (1, 2) did, at 1, 4 and 8: the earliest is continued
    assert proposal.match_length == 2 and proposal.match_count == 3
    assert proposal.tokens == (3, 1, 2, 4)
    assert proposal.distance == len(context) - 3 and proposal.source == "prompt"
    following = [context[s + 2 : s + 6] for s in (1, 4, 8)]  # [3,1,2,4], [4,9,1,2], [3,7,1,2]
    expected = [np.mean([f[: j + 1] == list(proposal.tokens[: j + 1]) for f in following]) for j in range(4)]
    assert proposal.scores == pytest.approx(expected)
    assert proposal.scores == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    latest = ngram_propose(context, 4, prompt_length=6, max_ngram=3, match="latest")
    assert latest.tokens == (3, 7, 1, 2) and latest.source == "output" and latest.distance == len(context) - 10


def test_ngram_cut_at_context_end_and_no_match():
    """A continuation runs at most to the context's end; a context whose last token never occurred proposes nothing."""
    assert ngram_propose([1, 2, 1], 5, prompt_length=3, max_ngram=2).tokens == (2, 1)
    assert ngram_propose([1, 2, 3], 5, prompt_length=3) == NO_PROPOSAL
    assert ngram_propose([1, 2, 1, 2], 5, prompt_length=4, max_ngram=3, min_ngram=3) == NO_PROPOSAL


suffix = pytest.mark.skipif(not suffix_available(), reason="arctic-inference is not installed (suffix drafts: "
                                                               "sh scripts/install.sh test builds it)")


@suffix
def test_suffix_proposals_follow_the_tree():
    """SuffixDecoding proposes the most frequent continuation of the matched suffix, from the request's own prompt and
    from other requests' outputs; `extend` makes new outputs visible."""
    proposer = SuffixProposer()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    proposer.start("a", prompt)
    first = proposer.propose("a", prompt, 8)
    assert first.tokens[0] == 4 and first.match_length == 3 and first.source == "prompt"
    assert first.match_count == 2 and all(0 < s <= 1 for s in first.scores)
    assert len(first.tokens) <= first.match_length  # SuffixDecoding's cap: max_spec_factor 1 · match length
    proposer.extend("a", [4, 7, 8, 9])
    proposer.stop("a")
    proposer.start("b", [0, 0, 7])
    other = proposer.propose("b", [0, 0, 7], 8)  # (7) occurred only in request a's output: the global tree
    assert other.tokens[:1] == (8,) and other.source == "output" and other.distance == 3
    assert proposer.propose("b", [0, 0, 7, 42], 8) == NO_PROPOSAL


def slow_copy_length(context: list[int], used: int, n: int, cap: int) -> int:
    """The tokens ending at the used match's end that equal those ending at the context's end, counted one by one."""
    length = 0
    while length < cap and used + n - 1 - length >= 0 and context[used + n - 1 - length] == context[-1 - length]:
        length += 1
    return length


@pytest.mark.parametrize("match", ["earliest", "latest"])
def test_copy_length_counts_the_verbatim_copy_back_from_the_match(match):
    rng = np.random.default_rng(3)
    for trial in range(300):
        piece = rng.integers(0, 4, size=int(rng.integers(2, 30))).tolist()
        context = piece + rng.integers(0, 4, size=int(rng.integers(0, 6))).tolist() + piece[: int(rng.integers(1, len(piece)))]
        proposal = ngram_propose(context, 4, prompt_length=len(piece), max_ngram=3, match=match)
        if not proposal.tokens:
            continue
        n = proposal.match_length
        used = len(context) - proposal.distance - n  # distance counts from the continuation's start
        cap = 5 if trial % 2 else 256
        assert copy_length(np.asarray(context), used, n, cap) == slow_copy_length(context, used, n, cap)
        if cap == 256:
            assert proposal.copy_length == slow_copy_length(context, used, n, cap), (context, proposal)
