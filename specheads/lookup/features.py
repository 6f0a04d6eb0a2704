"""The token-only inputs of a free draft's proposed tokens: what an engine that sees only token ids knows about each
proposed position before the target verifies it.

Every input is a function of the verified context (the proposal is read from it: its tokens, the match's length,
count and distance, the per-token frequency scores, the source) and of the outcomes of this request's earlier rounds
(`RoundHistory`), never of a token after the round's start. So a head reading them may score the whole proposal
before choosing how much of it to verify, and gen, our decoder and vLLM's proposer compute the same vector.

This module imports only the standard library and numpy: vLLM's environment imports it
(`specheads.integrations.vllm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
    "rounds",            # log(1 + rounds this request has verified)
    "last_drafted",      # tokens the last round verified
    "last_accepted",     # of which accepted
    "last_rate",         # their share (0 before any round)
    "last_full",         # 1 when the last round accepted all it verified (and verified at least one)
    "mean_rate",         # decayed mean of the rounds' acceptance shares (0.5 before any)
    "mean_accepted",     # decayed mean of the rounds' accepted counts (0 before any)
)
"""The columns of `token_features`, in order (a head records them and refuses other inputs)."""

HISTORY_DECAY = 0.7
"""The weight of the running means on their past at each round: a round's share has weight 0.3, and one ten rounds back
about 0.01."""

PRIOR_RATE = 0.5
"""The decayed mean acceptance share before any round."""


class ProposalLike(Protocol):
    """What `token_features` reads of a proposal (`specheads.lookup.proposers.Proposal`)."""

    tokens: tuple[int, ...]
    match_length: int
    match_count: int
    distance: int
    scores: tuple[float, ...]
    source: str


@dataclass
class RoundHistory:
    """What a decoder (or vLLM's proposer) keeps per request: the outcomes of its verified rounds, summarised as the
    last round's counts and decayed means. `record` each round after its verify; a round that verified nothing
    (speculation skipped) counts as a round but leaves the means alone."""

    rounds: int = 0
    last_drafted: int = 0
    last_accepted: int = 0
    mean_rate: float = PRIOR_RATE
    mean_accepted: float = 0.0
    decay: float = HISTORY_DECAY

    def record(self, drafted: int, accepted: int) -> None:
        """Add a round that verified `drafted` proposed tokens and accepted the first `accepted` of them."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"a round accepts between 0 and the {drafted} tokens it verified, got {accepted}")
        self.rounds += 1
        self.last_drafted, self.last_accepted = drafted, accepted
        if drafted:
            self.mean_rate = self.decay * self.mean_rate + (1 - self.decay) * accepted / drafted
            self.mean_accepted = self.decay * self.mean_accepted + (1 - self.decay) * accepted

    @classmethod
    def of_rounds(cls, drafted: list[int], accepted: list[int], decay: float = HISTORY_DECAY) -> RoundHistory:
        """The history after rounds with these counts, in order (e.g. vLLM's per_step_drafted, per_step_accepted)."""
        history = cls(decay=decay)
        for verified, stood in zip(drafted, accepted, strict=True):
            history.record(int(verified), int(stood))
        return history

    def copy(self) -> RoundHistory:
        """An independent copy."""
        return RoundHistory(self.rounds, self.last_drafted, self.last_accepted, self.mean_rate, self.mean_accepted,
                            self.decay)

    def values(self) -> list[float]:
        """The history's columns of `FEATURE_NAMES` ("rounds" to "mean_accepted")."""
        rate = self.last_accepted / self.last_drafted if self.last_drafted else 0.0
        full = float(self.last_drafted > 0 and self.last_accepted == self.last_drafted)
        return [math.log1p(self.rounds), float(self.last_drafted), float(self.last_accepted), rate, full,
                self.mean_rate, self.mean_accepted]


def token_features(proposal: ProposalLike | Any, history: RoundHistory) -> np.ndarray:
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
    out[:, 9:] = np.asarray(history.values(), dtype=np.float32)
    return out
