"""Free drafts read from the context: prompt lookup (n-gram) and SuffixDecoding's suffix trees.

A proposal is a function of the verified context (and, for suffix drafts, of earlier requests' outputs), so it costs no
model forward, and a decoder may read all of it before choosing how much of it to verify (docs/method.md, "Free
drafts").

This module imports only the standard library, numpy and (lazily, for suffix drafts) arctic_inference: vLLM's
environment imports it.

**The n-gram rule** (`ngram_propose`) is that of transformers' `PromptLookupCandidateGenerator.get_candidates`
(transformers 5.x, `generation/candidate_generator.py`) and vLLM's `NgramProposer`
(`vllm/v1/spec_decode/ngram_proposer.py`, `_find_longest_matched_ngram_and_propose_tokens`): take the last n tokens
of the context, n from `max_ngram` down to `min_ngram`; the first n with an earlier occurrence wins; the proposal is
the (at most k) tokens after that occurrence, cut at the end of the context. Both implementations take the
**earliest** occurrence (transformers walks its matches left to right and keeps the first; vLLM's reversed KMP scan
overwrites its position while the match is as long, which ends at the leftmost), and so does this function by
default; `match="latest"` takes the most recent one instead. Where the two differ:
- transformers starts at n = min(max_ngram, len − 1) and always goes down to 1 (no `min_ngram`); vLLM needs at least
  `min_ngram` context tokens and caps k at the model's length;
- transformers cuts the proposal at its first end-of-sequence token (an eos proposed first gives no proposal: it does
  not look for another match), at `max_length` and at tokens a logits processor forbids; vLLM cuts at
  `max_model_len`. Here no token is cut: the decoder ends its output at a stop token, and a caller caps k.
Where the rules agree (no eos in the proposal, room left), the proposals are token-identical
(tests/test_lookup_proposers.py).

**Suffix drafts** (`SuffixProposer`) are arctic-inference's `SuffixDecodingCache` (Snowflake's SuffixDecoding): one
suffix tree per active request over its prompt and outputs, and one global tree over every request's outputs (the
finished ones and those still running), the proposal being the most frequent continuation of the longest matched
suffix, limited to `max_spec_factor · match_length + max_spec_offset` tokens and to tokens whose estimated probability
is at least `min_token_prob`; the better-scored of the two trees' proposals wins. It is an optional extra
(`pip install "specheads[suffix]"`, built from source: `pip install nanobind numpy` first).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

SUFFIX_INSTALL = ('suffix drafts need arctic-inference: pip install nanobind numpy && pip install --no-build-isolation '
                  '"arctic-inference==0.3.0" (or pip install -e ".[suffix]" after the first command)')


@dataclass(frozen=True)
class Proposal:
    """A free draft's proposal for the next tokens of a context, and what is known about it before any verify."""

    tokens: tuple[int, ...]  # the proposed continuation, at most k tokens (empty: no match)
    match_length: int  # n of the matched n-gram / the suffix match length (0: none)
    match_count: int  # earlier occurrences of that n-gram (or suffix) in the context
    distance: int  # tokens from the used match's end to the context's end (recency); for a suffix proposal read
    # from other requests' outputs alone, the context's length
    scores: tuple[float, ...]  # per proposed token, a frequency score in [0, 1]: for n-gram, the share of the matched
    # n-gram's earlier occurrences whose continuation agrees with the proposal up to and including that token; for
    # suffix, SuffixDecoding's own probabilities
    source: str  # "prompt" if the match lies in the prompt, else "output" (vLLM's acceptance table keys on it)
    copy_length: int = 0  # how far back the context's end agrees with the text before the used match, the match
    # included, up to COPY_CAP (a long verbatim copy in progress); for suffix, the suffix match length

    def __len__(self) -> int:
        return len(self.tokens)


COPY_CAP = 256
"""The most tokens `copy_length` looks back."""

NO_PROPOSAL = Proposal(tokens=(), match_length=0, match_count=0, distance=0, scores=(), source="output")
"""A context with no match: nothing to verify, the round is a plain target step."""


def copy_length(context: np.ndarray, match_start: int, match_length: int, cap: int = COPY_CAP) -> int:
    """How many tokens the context's last ones agree with those ending at the used match's end (the match's
    `match_length` tokens included), looking back at most `cap`."""
    end = len(context)
    before = context[max(0, match_start - cap + match_length): match_start][::-1]
    recent = context[max(0, end - match_length - len(before)): end - match_length][::-1]
    span = min(len(before), len(recent))
    differs = np.flatnonzero(before[:span] != recent[:span])
    return min(cap, match_length + (int(differs[0]) if len(differs) else span))


def accepted_prefix(tokens: tuple[int, ...], continuation: list[int]) -> int:
    """How many of `tokens` a point-mass draft verify accepts when the output goes on with `continuation`: the
    longest common prefix."""
    count = 0
    for proposed, output in zip(tokens, continuation):
        if proposed != output:
            break
        count += 1
    return count


def occurrences(context: np.ndarray, pattern: np.ndarray, end: int) -> np.ndarray:
    """The starts of the occurrences of `pattern` in `context` that end before index `end` (sorted)."""
    n = len(pattern)
    if n == 0 or end < n:
        return np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(context[:end], n)
    return np.flatnonzero((windows == pattern).all(axis=1))


def agreement_scores(context: np.ndarray, starts: np.ndarray, tokens: np.ndarray) -> tuple[float, ...]:
    """Per proposed token j, the share of the continuations starting at `starts` that agree with `tokens[: j + 1]`
    (a continuation cut by the context's end agrees with nothing past it)."""
    if len(starts) == 0 or len(tokens) == 0:
        return ()
    index = starts[:, None] + np.arange(len(tokens))[None, :]
    inside = index < len(context)
    following = np.where(inside, context[np.minimum(index, len(context) - 1)], -1)
    agree = np.logical_and.accumulate(following == tokens[None, :], axis=1)
    return tuple(float(share) for share in agree.mean(axis=0))


def ngram_propose(context: Sequence[int], k: int, prompt_length: int, max_ngram: int = 3, min_ngram: int = 1,
                  match: Literal["earliest", "latest"] = "earliest") -> Proposal:
    """Prompt lookup's proposal of at most `k` tokens after `context` (module docstring: transformers' and vLLM's
    rule), its first `prompt_length` tokens being the prompt. `match`: which earlier occurrence of the matched
    n-gram is continued (both references take the earliest)."""
    if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"prompt lookup needs k >= 1 and 1 <= min_ngram <= max_ngram, got k={k}, "
                         f"min_ngram={min_ngram}, max_ngram={max_ngram}")
    array = np.asarray(context, dtype=np.int64)
    length = len(array)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # an earlier occurrence ends before the last token, so at least one token follows it
        starts = occurrences(array, array[length - n:], length - 1)
        if len(starts) == 0:
            continue
        used = int(starts[0] if match == "earliest" else starts[-1])
        begin = used + n
        tokens = array[begin : begin + k]
        return Proposal(tokens=tuple(int(t) for t in tokens), match_length=n, match_count=len(starts),
                        distance=length - begin, scores=agreement_scores(array, starts + n, tokens),
                        source="prompt" if begin <= prompt_length else "output",
                        copy_length=copy_length(array, used, n))
    return NO_PROPOSAL


def load_suffix_cache() -> Any:
    """arctic-inference's `SuffixDecodingCache` class; ImportError with the install line where it is missing."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:
        raise ImportError(SUFFIX_INSTALL) from error
    return SuffixDecodingCache


def suffix_available() -> bool:
    """Whether arctic-inference's suffix trees import here."""
    try:
        load_suffix_cache()
    except ImportError:
        return False
    return True


class SuffixProposer:
    """SuffixDecoding's proposals (module docstring) for several requests at once: `start` a request with its prompt,
    `propose` after its context, `extend` it with its newly verified tokens, `stop` it when it ends (its output stays
    in the global tree, as SuffixDecoding keeps it, up to `max_cached_requests`; -1: no limit). Defaults are
    SuffixDecoding's (arctic-inference's `speculate`: factor 1, offset 0, min probability 0.1; tree depth 64)."""

    def __init__(self, max_tree_depth: int = 64, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = -1) -> None:
        self.cache = load_suffix_cache()(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.max_spec_factor, self.max_spec_offset, self.min_token_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.prompts: dict[Any, np.ndarray] = {}
        self.keys: dict[Any, tuple[Any, int]] = {}
        self.ids = itertools.count()  # the cache's own keys: a caller's id may return after its request stopped

    def start(self, request_id: Any, prompt: Sequence[int]) -> None:
        """Begin `request_id` with its `prompt` (a request still active under that id is stopped first)."""
        if request_id in self.prompts:
            self.stop(request_id)
        key = (request_id, next(self.ids))
        self.cache.start_request(key, [int(t) for t in prompt])
        self.prompts[request_id] = np.asarray(prompt, dtype=np.int64)
        self.keys[request_id] = key

    def extend(self, request_id: Any, new_tokens: Sequence[int]) -> None:
        """Add the request's newly verified output tokens to its tree and to the global one."""
        if len(new_tokens):
            self.cache.add_active_response(self.keys[request_id], [int(t) for t in new_tokens])

    def stop(self, request_id: Any) -> None:
        """End the request: its prompt's tree is dropped, its output stays in the global tree."""
        self.cache.stop_request(self.keys.pop(request_id))
        del self.prompts[request_id]

    def propose(self, request_id: Any, context: Sequence[int], k: int) -> Proposal:
        """SuffixDecoding's proposal of at most `k` tokens after `context` (the request's prompt and the outputs
        `extend` gave it), with its probabilities as scores."""
        array = np.asarray(context, dtype=np.int64)
        draft = self.cache.speculate(self.keys[request_id], [int(t) for t in array[-self.cache.max_tree_depth:]],
                                     max_spec_tokens=k, max_spec_factor=self.max_spec_factor,
                                     max_spec_offset=self.max_spec_offset, min_token_prob=self.min_token_prob)
        if not draft.token_ids:
            return NO_PROPOSAL
        tokens = np.asarray(draft.token_ids[:k], dtype=np.int64)
        matched = array[len(array) - draft.match_len:]
        starts = occurrences(array, matched, len(array) - 1)
        agreeing = starts[array[np.minimum(starts + len(matched), len(array) - 1)] == tokens[0]]
        prompt = self.prompts[request_id]
        in_prompt = len(occurrences(prompt, np.concatenate([matched, tokens[:1]]), len(prompt))) > 0
        return Proposal(tokens=tuple(int(t) for t in tokens), match_length=int(draft.match_len),
                        match_count=len(starts),
                        distance=len(array) - int(agreeing[-1]) - len(matched) if len(agreeing) else len(array),
                        scores=tuple(float(p) for p in draft.probs[:k]), source="prompt" if in_prompt else "output",
                        copy_length=min(int(draft.match_len), COPY_CAP))
