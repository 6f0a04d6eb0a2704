"""Stop policies of speculative decoding: when the draft stops proposing and the target verifies.

After drafting candidate ŷ_k a policy sees the draft's signals for ŷ_k and, for a learned stop head, the
product of the acceptance predictions it already has (docs/method.md "Decision timing at inference"): an
`at_draft` head (specdecpp_ontime) has scored ŷ_k itself, so the product is Π_{j≤k} â_j; a
`one_step_late` head (specdecpp_resnet) reads the state that has read ŷ_j, which exists only once
ŷ_{j+1} is drafted, so at step k it knows â_1..â_{k-1}.
Every policy caps a round at `max_draft` candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from specheads.errors import UsageError


@dataclass(frozen=True)
class Drafted:
    """What a policy sees after the draft proposed candidate number `index` (1-based) of a round."""

    index: int
    prob: float  # the draft's probability of the candidate (untempered under greedy decoding)
    entropy: float  # H(q) at the step that drafted it (untempered under greedy decoding)
    acceptance: float  # Π â_j over the round's candidates the head has scored (1.0 before it has one)


@dataclass(frozen=True)
class StopPolicy:
    """Base: stop at the cap. `threshold` is the policy's knob (K for constant K)."""

    threshold: float
    max_draft: int = 8

    name: ClassVar[str] = ""
    reads_head: ClassVar[bool] = False
    hindsight: ClassVar[bool] = False  # the oracle counts only the candidates it would have kept

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise UsageError(f"max_draft must be at least 1, got {self.max_draft}")

    def stop(self, drafted: Drafted) -> bool:
        """True when the round ends after this candidate."""
        return drafted.index >= self.max_draft or self.signal_says_stop(drafted)

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return False


@dataclass(frozen=True)
class ConstantK(StopPolicy):
    """Always K candidates per round (the usual default of speculative decoding)."""

    name: ClassVar[str] = "constant_k"

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.threshold != int(self.threshold):
            raise UsageError(f"constant K must be a whole number >= 1, got {self.threshold}")

    def stop(self, drafted: Drafted) -> bool:
        return drafted.index >= int(self.threshold)


@dataclass(frozen=True)
class Svip(StopPolicy):
    """SVIP: stop when sqrt(H(q)) > h at the step that drafted the candidate."""

    name: ClassVar[str] = "svip"

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return math.sqrt(max(drafted.entropy, 0.0)) > self.threshold


@dataclass(frozen=True)
class Confidence(StopPolicy):
    """Draft confidence (transformers' assisted generation): stop when q(ŷ) < h."""

    name: ClassVar[str] = "confidence"

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return drafted.prob < self.threshold


@dataclass(frozen=True)
class HeadStop(StopPolicy):
    """SpecDec++: stop when the predicted chance of at least one rejection, 1 − Π â, exceeds h."""

    name: ClassVar[str] = "head"
    reads_head: ClassVar[bool] = True

    def signal_says_stop(self, drafted: Drafted) -> bool:
        return 1.0 - drafted.acceptance > self.threshold


@dataclass(frozen=True)
class Oracle(StopPolicy):
    """The hindsight oracle of SpecDec++ Theorem 4.1: stop just before the first candidate the target rejects.

    It drafts up to the cap and counts only the accepted candidates as drafted, so it never discards a
    token; the target's call then yields the token at the first rejection (exact, as in a normal round).
    """

    name: ClassVar[str] = "oracle"
    hindsight: ClassVar[bool] = True


POLICIES: dict[str, type[StopPolicy]] = {cls.name: cls for cls in (ConstantK, Svip, Confidence, HeadStop, Oracle)}


def make_policy(name: str, threshold: float, max_draft: int = 8) -> StopPolicy:
    """The stop policy `name` at `threshold` (K for constant_k); an unknown name lists the known ones."""
    if name not in POLICIES:
        raise UsageError(f"unknown stop policy {name!r}; known: {', '.join(POLICIES)}")
    if name == "constant_k":
        return ConstantK(threshold=threshold, max_draft=int(threshold))
    return POLICIES[name](threshold=threshold, max_draft=max_draft)
