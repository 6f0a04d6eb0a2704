"""What a head was trained on, and so where a decoder may use it: its role.

A head's class says what it reads and when it decides (`purpose`, `reads`); what it was trained on says which tokens
its scores describe. Four roles:

- `chain_stop`: a stop head of drafted candidates (SpecDec++'s `specdecpp_resnet`, the on-time `specdecpp_ontime`):
  the head of a chain stop rule (`head`, `head_cost`) or of a head-valued tree's first children.
- `expected_acceptance`: the ex-ante heads (`expected_acceptance`, and `dspark_confidence`, the form engines run inside
  a DSpark drafter; α before the draw): a verify budget's head (`budget`, `goodput`), and also a chain stop rule's or
  a tree's head.
- `sibling`: a head trained on a tree's second children (`data.children: second`): only
  `decode_tree(..., sibling_head=)`.
- `verifier`: SPRINTER's verifier (`sprinter_linear`): only the `sprinter` rule.

config.json records the role (`role`); a head exported before it did gets the role its `purpose` and
`training_data.split.children` imply (`role_of`). Every consumer refuses a head of another role (`check_role`).
This module imports nothing of specheads but its errors.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from specheads.plumbing.errors import UsageError

CHAIN_STOP, EXPECTED_ACCEPTANCE, SIBLING, VERIFIER = "chain_stop", "expected_acceptance", "sibling", "verifier"
ROLES = {
    CHAIN_STOP: "a chain stop head (trained on drafted candidates)",
    EXPECTED_ACCEPTANCE: "an expected-acceptance head (α before the draw, for a verify budget)",
    SIBLING: "a sibling head (trained on a tree's second children)",
    VERIFIER: "a SPRINTER verifier",
}
"""Each role, in words."""
USES = {
    CHAIN_STOP: "a chain rule's head (head, head_cost) or a head-valued tree's head=",
    EXPECTED_ACCEPTANCE: "a verify budget's head (budget, goodput), a chain rule's head or a tree's head=",
    SIBLING: "decode_tree(..., sibling_head=) beside a chain head",
    VERIFIER: "the sprinter rule's head (specheads eval decodes it so)",
}
"""Where a head of each role belongs: the fix a refusal names."""
CHAIN_HEADS = (CHAIN_STOP, EXPECTED_ACCEPTANCE)
"""The roles a chain stop rule, a tree's head= and `generate` take."""
ROLE_OF_PURPOSE = {"stop": CHAIN_STOP, "expect": EXPECTED_ACCEPTANCE, "verify": VERIFIER}
"""The role of a head of each purpose trained on drafted candidates (`data.children: first`)."""
CHILDREN = ("first", "second")


def role_of(purpose: str, children: Any = "first") -> str:
    """The role of a head of `purpose` trained on `children` (`data.children`: first, or a tree's second)."""
    if children not in CHILDREN:
        raise UsageError(f"children must be one of {', '.join(CHILDREN)}, got {children!r}")
    if purpose not in ROLE_OF_PURPOSE:
        raise UsageError(f"unknown head purpose {purpose!r}; known: {', '.join(ROLE_OF_PURPOSE)}")
    return SIBLING if children == "second" else ROLE_OF_PURPOSE[purpose]


def roles_for(purpose: str, reads: str) -> tuple[str, ...]:
    """The roles a head of `purpose` reading `reads` can be trained for: its purpose's, and `sibling` for a stop or
    expected-acceptance head that scores from the parent's state (what a tree has when it draws a sibling)."""
    own = ROLE_OF_PURPOSE[purpose]
    return (own, SIBLING) if purpose in ("stop", "expect") and reads == "context_state" else (own,)


def head_role(head: Any) -> str | None:
    """The head's role: the one it records, else its purpose's (a head built in memory)."""
    return getattr(head, "role", None) or ROLE_OF_PURPOSE.get(getattr(head, "purpose", None))


def check_role(head: Any, allowed: Collection[str], where: str) -> None:
    """Refuse, in one line, a head whose role is not among `allowed` for `where` (e.g. "the head rule's head=")."""
    role = head_role(head)
    if role in allowed:
        return
    wanted = " or ".join(ROLES[name] for name in allowed)
    found = ROLES.get(role, f"a head of unknown role {role!r}")
    raise UsageError(f"{where} takes {wanted}; this {getattr(head, 'head_type', type(head).__name__)} head is {found} "
                     f"(role {role!r}) and belongs in {USES.get(role, 'no decoder')}: give {where} a head trained for it")
