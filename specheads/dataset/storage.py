"""Which draft states a labelled dataset keeps, and in which dtype (docs/data.md "Storage at scale").

A row's states are [n + 1, h]: row 0 is the prompt's last position, row i the state that has read z_i.
`features_at` decides which rows are written:

- `all`: every row; every head trains on it.
- `drafted`: at each drafted position j (0-based, `is_draft[j]`) the two rows a stop head reads there: row j + 1
  (the state that has read ŷ_{j+1}: SpecDec++'s `candidate_state`) and row j (the state before it: the on-time
  head's `context_state`).
- `drafted_candidate`: only row j + 1 (SpecDec++'s head).
- `drafted_context`: only row j (the on-time head).

A SPRINTER verifier (`verify`) learns at target-token contexts, which the drafted options drop: only `all` serves it.
The kept rows follow from `is_draft`, so they are not stored; readers recompute them with `kept_rows`.

`features_dtype` is float16 or bfloat16; both take 2 bytes a value. Arrow has no bfloat16, so its 16 bits are stored
as uint16 and read back as bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from specheads.plumbing.errors import UsageError

FeaturesAt = Literal["all", "drafted", "drafted_candidate", "drafted_context"]
FeaturesDtype = Literal["float16", "bfloat16"]

CANDIDATE_ROWS = ("all", "drafted", "drafted_candidate")  # keep row j + 1 of a drafted position j
CONTEXT_ROWS = ("all", "drafted", "drafted_context")  # keep row j
ARROW_DTYPES = {"float16": "float16", "bfloat16": "uint16"}


@dataclass(frozen=True)
class FeatureStorage:
    """Where (`at`) and how (`dtype`) a dataset stores the draft's states."""

    at: FeaturesAt = "all"
    dtype: FeaturesDtype = "float16"

    @property
    def arrow_dtype(self) -> str:
        """The Arrow value type of the `features` column."""
        return ARROW_DTYPES[self.dtype]

    def rows(self, is_draft: np.ndarray) -> np.ndarray:
        """`kept_rows` of one row."""
        return kept_rows(is_draft, self.at)

    def encode(self, states: torch.Tensor) -> np.ndarray:
        """States [k, h] as the array the Arrow writer stores: float16, or bfloat16's bits as uint16."""
        if self.dtype == "bfloat16":
            return states.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
        return states.to(torch.float16).cpu().numpy()

    def identity(self) -> dict[str, str]:
        """The fields the data fingerprint records: only those that differ from the default, so that data made before
        the options keeps its fingerprint."""
        return {**({"features_at": self.at} if self.at != DEFAULT_STORAGE.at else {}),
                **({"features_dtype": self.dtype} if self.dtype != DEFAULT_STORAGE.dtype else {})}


DEFAULT_STORAGE = FeatureStorage()
"""Every state, float16: what data made before the options holds."""


def storage_of(identity: dict) -> FeatureStorage:
    """The storage a manifest's identity records."""
    return FeatureStorage(identity.get("features_at", "all"), identity.get("features_dtype", "float16"))


def kept_rows(is_draft: np.ndarray, features_at: str) -> np.ndarray:
    """Sorted indices of the rows of a row's [n + 1, h] states that `features_at` keeps (n = len(is_draft))."""
    is_draft = np.asarray(is_draft, dtype=bool)
    if features_at == "all":
        return np.arange(len(is_draft) + 1)
    drafted = np.flatnonzero(is_draft)
    parts = [drafted + 1] if features_at in CANDIDATE_ROWS else []
    parts += [drafted] if features_at in CONTEXT_ROWS else []
    return np.unique(np.concatenate(parts)).astype(np.int64)


def as_tensor(values: np.ndarray) -> torch.Tensor:
    """Stored states as a tensor in their stored dtype: float16, or uint16 bits read as bfloat16."""
    if values.dtype == np.uint16:
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def float_values(values: np.ndarray) -> np.ndarray:
    """Stored values as floats (uint16 is bfloat16's bits: its float32 has them as the high half)."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


def serves(features_at: str, reads: str, purpose: str) -> bool:
    """Whether data keeping the rows `features_at` names holds every state a head that `reads` this state and learns
    for `purpose` trains on (stop heads: drafted positions; verify heads: target contexts too)."""
    if features_at == "all":
        return True
    if purpose != "stop":
        return False
    return features_at in (CANDIDATE_ROWS if reads == "candidate_state" else CONTEXT_ROWS)


def require_states(features_at: str, head: str, reads: str, purpose: str, where: str) -> None:
    """Refuse, in one line, a head whose states the data at `where` did not keep."""
    if not serves(features_at, reads, purpose):
        positions = "drafted positions" if purpose == "stop" else "target-token contexts as well as drafted ones"
        raise UsageError(f"{where} keeps the draft states only where `features_at: {features_at}` says, but a {head} "
                         f"head reads the {reads} at {positions}; train a head it serves, train online "
                         "(--data.mode online), or label the data again with --features_at all")
