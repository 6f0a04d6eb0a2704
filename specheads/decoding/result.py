"""One decoding run's output and the counts every figure is made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeResult:
    """One decoding run: the generated tokens and the counts the metrics are made of."""

    tokens: list[int]
    emitted: int = 0  # tokens in the output, ended at max_new_tokens or the first stop token (the rates' numerator)
    drafted: int = 0  # candidates proposed (the oracle counts only those it keeps)
    accepted: int = 0  # candidates that stand in the output
    target_calls: int = 0
    draft_forwards: float = 0  # with SV's companion, its forwards too, each at its cost in draft forwards; the
    # oracle counts one per candidate it keeps (it would draft no other), as eval's accounting of it does
    companion_forwards: int = 0
    head_scored: int = 0  # tokens an acceptance head scored (a stop or expected-acceptance head, a sibling head, the
    # SPRINTER verifier): each a head forward's worth of work (SV's companion's forwards are `companion_forwards`)
    head_forwards: float = 0.0  # those forwards in draft forwards, each at its head's cost (`head_forward_cost`)
    head_widths_per_round: list[list[int]] = field(default_factory=list)  # per round that called the target: the tokens
    # the head scored at each of its draft forwards; empty without a head
    accepted_per_round: list[int] = field(default_factory=list)  # per round that called the target
    drafted_per_round: list[int] = field(default_factory=list)  # candidates each such round drafted
    draft_widths_per_round: list[list[int]] = field(default_factory=list)  # per such round, the tokens each draft
    # forward read: the first, the tokens its draft had not read (its catch-up: the target's token, the last candidate
    # after a round that accepted them all, one more per round of plain decoding since), then one a chain step, the
    # nodes read together for a tree
    seconds: float = 0.0
    forward_seconds: float = 0.0
    draft_seconds: float = 0.0  # time in the draft's forwards (a batched run's share of its batch's)
    target_seconds: float = 0.0
    draft_passes: float = 0.0  # the draft's forward passes (a batched run's share of its batch's)
    target_passes: float = 0.0

    def time_forwards(self, draft: Any, target: Any, share: float = 1.0) -> None:
        """Record `share` of each model's timed forwards (`forward_seconds` and `passes` of a cache)."""
        self.draft_seconds, self.draft_passes = draft.forward_seconds * share, draft.passes * share
        self.target_seconds, self.target_passes = target.forward_seconds * share, target.passes * share
        self.forward_seconds = self.draft_seconds + self.target_seconds
