"""The token-only inputs of a free draft's proposed tokens: what an engine that sees only token ids knows about each
proposed position before the target verifies it.

Every input is a function of the verified context alone (the proposal is read from it: its tokens, the match's length,
count and distance, the per-token frequency scores, the source, how long a verbatim copy is in progress), never of a
token after the round's start nor of how earlier rounds were verified. So a head reading them may score the whole
proposal before choosing how much of it to verify; gen, our decoder, vLLM's proposer and the logs' reader compute the
same vector whatever rule ran (inputs read from a request's past rounds would differ between the full verifies gen
labels and the cut ones a head's rule runs, and a head fed its own cuts would drift from what it was trained on).

This module imports only the standard library and numpy: vLLM's environment imports it
(`specheads.integrations.vllm`).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

FEATURE_NAMES: tuple[str, ...] = (
    "position",          # k, the token's 1-based position in the proposal
    "proposal_length",   # how many tokens were proposed
    "match_length",      # tokens of the matched n-gram (suffix: the matched suffix)
    "log_match_count",   # log(1 + earlier occurrences of the match)
    "log_distance",      # log(1 + tokens between the match and the end of the context)
    "score",             # the token's frequency score in [0, 1]
    "min_score",         # the least score of tokens 1..k
    "product_score",     # the product of the scores of tokens 1..k
    "from_output",       # 1 when the match lies in the request's output, 0 in its prompt
    "log_copy_length",   # log(1 + tokens the context's end agrees with the text before the match, the match included)
)
"""The columns of `token_features`, in order (a head records them and refuses other inputs)."""


class ProposalLike(Protocol):
    """What `token_features` reads of a proposal (`specheads.lookup.proposers.Proposal`)."""

    tokens: tuple[int, ...]
    match_length: int
    match_count: int
    distance: int
    scores: tuple[float, ...]
    source: str
    copy_length: int


def token_features(proposal: ProposalLike | Any) -> np.ndarray:
    """The inputs [len(proposal.tokens), len(FEATURE_NAMES)] (float32) of every proposed token, in `FEATURE_NAMES`
    order: all known before the proposal is verified."""
    count = len(proposal.tokens)
    if len(proposal.scores) != count:
        raise ValueError(f"a proposal of {count} tokens has {len(proposal.scores)} scores; give one per token")
    out = np.empty((count, len(FEATURE_NAMES)), dtype=np.float32)
    if not count:
        return out
    scores = np.asarray(proposal.scores, dtype=np.float64)
    out[:, 0] = np.arange(1, count + 1)
    out[:, 1] = count
    out[:, 2] = proposal.match_length
    out[:, 3] = math.log1p(proposal.match_count)
    out[:, 4] = math.log1p(proposal.distance)
    out[:, 5] = scores
    out[:, 6] = np.minimum.accumulate(scores)
    out[:, 7] = np.cumprod(scores)
    out[:, 8] = float(proposal.source == "output")
    out[:, 9] = math.log1p(proposal.copy_length)
    return out
