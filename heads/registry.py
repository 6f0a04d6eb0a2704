"""Head classes by their `head_type`, and building one from a name and its constructor arguments."""

from __future__ import annotations

import inspect
from typing import Any

from specheads.heads.base import AcceptanceHead
from specheads.heads.dspark import DSparkConfidenceHead
from specheads.heads.linear import LinearVerifier
from specheads.heads.lookup import TokenHeadModel
from specheads.heads.resnet import ExpectedAcceptanceHead, OnTimeAcceptanceHead, ResNetAcceptanceHead
from specheads.lookup.token_head import HEAD_TYPES
from specheads.plumbing.errors import UsageError

HEADS: dict[str, type[AcceptanceHead]] = {cls.head_type: cls for cls in (ResNetAcceptanceHead, OnTimeAcceptanceHead,
                                                                          ExpectedAcceptanceHead, LinearVerifier,
                                                                          DSparkConfidenceHead)}
TOKEN_HEADS: dict[str, type[TokenHeadModel]] = {name: TokenHeadModel for name in HEAD_TYPES}
"""The token-only heads of free drafts (`heads.lookup`): they read token features, not a draft's state."""


def head_class(name: str) -> type[AcceptanceHead]:
    """The head class registered under `name`; a UsageError listing the known names otherwise."""
    try:
        return HEADS[name]
    except KeyError:
        raise UsageError(f"unknown head type {name!r}; known: {', '.join(HEADS)}") from None


def build_head(name: str, **kwargs: Any) -> AcceptanceHead:
    """A fresh head of type `name` built from its constructor arguments (which become its config)."""
    cls = head_class(name)
    signature = inspect.signature(cls)
    try:
        signature.bind(**kwargs)
    except TypeError as error:
        raise UsageError(f"head {name!r}: {error}; it takes {', '.join(signature.parameters)}") from None
    return cls(**kwargs)
