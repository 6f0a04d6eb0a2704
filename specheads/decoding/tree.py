"""Tree drafts (B = 1): a token tree whose shape the values decide, verified exactly in one target forward.

A round:
1. **draft**: the draft reads the context and opens the root (its q). Every node the draft has read has *slots* for
   children; a slot's **reach** is the estimated chance that verification gets to it: the node's value times
   Π (1 − s) over the children already drawn there. The slot of highest reach is filled next, while it is at least
   the rule's `floor` and the tree has fewer than `budget` nodes. Filling a slot draws a child from the node's q
   without replacement (q without the earlier children, renormalised), or, for fixed children (`children: top`,
   EAGLE's sampling mode, and always under greedy decoding, where q is one-hot), takes the next-best token of q (of
   the untempered draft under greedy). The child's score s is its draft confidence q(x) (for a fixed child, q(x)
   over the mass its earlier siblings left, so that a value is Π q along the path, EAGLE-2's) or a head's
   acceptance â(x), and its value is reach × s. When the best slot is the first child of a node the
   draft has not read, the draft reads up to `expand` such nodes, best first, in one forward with a tree mask
   (EAGLE-2's top-k expansion). Stop tokens are not expanded.
2. **verify**: one target forward over the context's new tokens and every node, each attending to its ancestors
   (`BatchCache.feed_tree`); from the root down, each node's children are checked by recursive rejection sampling
   (`specheads.decoding.sampler.verify_siblings`); an accepted child continues the walk, a leaf earns a bonus draw
   from p, all rejected ends it with a draw from the last residual.
3. **emit**: the accepted path and that token, ended at a stop token and max_new_tokens; both caches hold the path.

Exact (docs/method.md, "Tree drafts"): every drawn child came from its q_i, and whether a slot was filled was settled
from what was known before its draw (values of earlier nodes, never the child's own token), so each sibling test is
a valid speculative-sampling step; nodes chosen rather than drawn (greedy) are exact whatever chose them. A value
that reads a drawn token decides only its descendants and later siblings, never whether that token is verified —
the budget's trap (ranking drawn tokens by a score that read them) is not open here.

With `width` 1 the tree is the chain: the slot rule is SpecDec++'s stop rule (draft on while Π â ≥ floor = 1 − h),
and a head-valued tree of width 1 decodes token for token what `HeadStop(h)` decodes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specheads.decoding.cache import BatchCache
from specheads.decoding.engine import RoundEngine, acceptance_batch, candidate_signals
from specheads.decoding.result import DecodeResult
from specheads.decoding.sampler import draw, verify_siblings
from specheads.errors import UsageError
from specheads.heads import AcceptanceHead
from specheads.signals import signal_log_probs

TREE_VALUES = ("confidence", "head")
TREE_CHILDREN = ("sampled", "top")


@dataclass(frozen=True)
class TreeRule:
    """How a round's tree grows: `values` ("confidence": draft confidence q(x), EAGLE-2's; "head": an acceptance
    head's â), `floor` (the least reach a slot is filled at), `budget` (N, the most nodes the target verifies per
    forward), `width` (most children per node), `expand` (most nodes the draft reads per forward) and `children`
    ("sampled": drawn from q without replacement; "top": q's best tokens, checked as fixed tokens, EAGLE's sampling
    mode; greedy decoding always takes the untempered draft's best tokens)."""

    values: str
    floor: float
    budget: int
    width: int = 4
    expand: int = 4
    children: str = "sampled"

    name: ClassVar[str] = "tree"
    hindsight: ClassVar[bool] = False  # counts every node as drafted (`RoundEngine._count`)

    def __post_init__(self) -> None:
        if self.values not in TREE_VALUES:
            raise UsageError(f"tree values must be one of {', '.join(TREE_VALUES)}, got {self.values!r}")
        if self.children not in TREE_CHILDREN:
            raise UsageError(f"tree children must be one of {', '.join(TREE_CHILDREN)}, got {self.children!r}")
        if not 0 <= self.floor <= 1:
            raise UsageError(f"the tree's floor is a probability in [0, 1], got {self.floor}")
        for knob in ("budget", "width", "expand"):
            if getattr(self, knob) < 1:
                raise UsageError(f"the tree's {knob} must be at least 1, got {getattr(self, knob)}")

    @property
    def reads_head(self) -> bool:
        return self.values == "head"

    def check_head(self, head: AcceptanceHead | None) -> None:
        """Refuse a head the tree cannot score children with."""
        if not self.reads_head:
            return
        if head is None:
            raise UsageError("a tree with head values needs an acceptance head")
        if head.decides not in ("at_draft", "before_draw"):
            raise UsageError(f"a tree scores each child from its parent's state; a {head.head_type} head decides "
                             f"{head.decides} (it reads the state after the child), use an at_draft or before_draw head")


@dataclass
class Node:
    """A drafted token of the tree: its parent (-1: the root), depth (1-based), the log-probs it was drawn from
    (None: chosen, not drawn), its score and value, and, once the draft has read it, its slot in the draft cache."""

    token: int
    parent: int
    depth: int
    proposal: torch.Tensor | None
    score: float
    value: float
    children: list[int] = field(default_factory=list)
    draft_slot: int | None = None


@dataclass
class Opened:
    """A node (or the root) the draft has read: its logits, q, state, ancestors' draft slots and what is left to
    draw from; `reach` is the reach of its next child slot."""

    logits: torch.Tensor
    logq: torch.Tensor
    state: torch.Tensor
    reach: float
    sees: list[int]
    left: torch.Tensor  # q without the children drawn so far (log, renormalised); unused for fixed children
    order: list[int] = field(default_factory=list)  # fixed children: the tokens to take, best first
    taken: float = 0.0  # fixed children: the draft probability of those already taken


@dataclass
class DraftTree:
    """A round's tree: its nodes in the order drawn (parents before children) and the root's children."""

    nodes: list[Node] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)
    opened: dict[int, Opened] = field(default_factory=dict)  # what the draft read: the root (-1) and expanded nodes

    def children(self, index: int) -> list[int]:
        return self.roots if index < 0 else self.nodes[index].children

    def path(self, index: int) -> list[int]:
        """The nodes from the root's child down to `index`."""
        path = []
        while index >= 0:
            path.append(index)
            index = self.nodes[index].parent
        return path[::-1]


class TreeDrafter:
    """Grows one round's tree from the draft's cache (module docstring, step 1)."""

    def __init__(self, engine: RoundEngine, rule: TreeRule, head: AcceptanceHead | None, generator: torch.Generator):
        self.engine, self.rule, self.head, self.generator = engine, rule, head, generator
        self.transform = engine.transform
        self.fixed = engine.transform.greedy or rule.children == "top"  # children chosen, not drawn

    def grow(self, draft: BatchCache, tail: list[int], depth_cap: int) -> DraftTree:
        """The tree after the context's `tail` (tokens the draft has not read; it reads them and holds them), with
        paths of at most `depth_cap` nodes (none at 0: the target's token alone fills the last slot)."""
        if depth_cap < 1:
            return DraftTree()
        logits, states = draft.feed({0: tail})[0]
        tree = DraftTree()
        opened = tree.opened
        opened[-1] = self._open(logits[-1], states[-1], 1.0, [])
        budget = self.rule.budget
        while len(tree.nodes) < budget:
            slot = max(((index, o.reach) for index, o in opened.items() if self._has_room(tree, index, o)),
                       key=lambda item: item[1], default=(None, -1.0))
            unread = sorted((i for i, n in enumerate(tree.nodes)
                             if i not in opened and n.depth < depth_cap and n.token not in self.engine.stop_ids
                             and n.value >= self.rule.floor),
                            key=lambda i: -tree.nodes[i].value)
            if unread and tree.nodes[unread[0]].value > slot[1]:
                self._read(draft, tree, opened, unread[: self.rule.expand])
                continue
            if slot[0] is None or slot[1] < self.rule.floor:
                break
            self._fill(tree, opened, slot[0])
        return tree

    def _has_room(self, tree: DraftTree, index: int, opened: Opened) -> bool:
        if len(tree.children(index)) >= self.rule.width:
            return False
        return len(opened.order) > len(tree.children(index)) if self.fixed else bool(torch.isfinite(opened.left).any())

    def _open(self, logits: torch.Tensor, state: torch.Tensor, reach: float, sees: list[int]) -> Opened:
        logq = self.transform.log_probs(logits)
        order = []
        if self.fixed:  # the draft's best tokens (untempered under greedy decoding, where q is one-hot)
            best = signal_log_probs(logits, logq, self.transform).topk(min(self.rule.width, logits.shape[-1]))
            order = best.indices[torch.isfinite(best.values)].tolist()
        return Opened(logits, logq, state, reach, sees, logq.clone(), order)

    def _read(self, draft: BatchCache, tree: DraftTree, opened: dict[int, Opened], chosen: list[int]) -> None:
        """The draft reads the `chosen` nodes in one forward, each attending to its ancestors."""
        base = draft.length(0)
        sees = [opened[tree.nodes[i].parent].sees + ([] if tree.nodes[i].parent < 0 else
                                                     [tree.nodes[tree.nodes[i].parent].draft_slot]) for i in chosen]
        logits, states, slots = draft.feed_tree([tree.nodes[i].token for i in chosen],
                                                [base + tree.nodes[i].depth - 1 for i in chosen], sees)
        for row, (index, slot) in enumerate(zip(chosen, slots)):
            tree.nodes[index].draft_slot = slot
            opened[index] = self._open(logits[row], states[row], tree.nodes[index].value, sees[row])

    def _fill(self, tree: DraftTree, opened: dict[int, Opened], parent: int) -> None:
        """Draw the next child of `parent` (without replacement), score it and add it to the tree."""
        at = opened[parent]
        siblings = tree.children(parent)
        if self.fixed:
            token, proposal = at.order[len(siblings)], None
        else:
            proposal = at.left.clone()
            token = draw(proposal, self.generator)
            at.left[token] = -math.inf
            at.left = at.left.log_softmax(-1) if torch.isfinite(at.left).any() else at.left
        depth = 1 if parent < 0 else tree.nodes[parent].depth + 1
        signals = candidate_signals(at.logits, at.logq, token, self.transform)
        score = min(max(self._score(at, signals, token, depth), 0.0), 1.0)
        tree.nodes.append(Node(token, parent, depth, proposal, score, at.reach * score))
        siblings.append(len(tree.nodes) - 1)
        at.reach *= 1.0 - score

    def _score(self, at: Opened, signals: dict[str, float], token: int, depth: int) -> float:
        """The child's score: the head's â, or its draft confidence; for a fixed child, its confidence over the mass
        the earlier siblings left (the chance it is the target's token once they were not), so that a node's value
        is Π q along its path, EAGLE-2's value."""
        if self.head is not None:
            return acceptance_batch(self.head, [at.state], [signals], [self.engine._embedding(self.head, token)],
                                    [depth])[0]
        if not self.fixed:
            return signals["prob"]
        score = signals["prob"] / max(1.0 - at.taken, 1e-9)
        at.taken += signals["prob"]
        return score


def verify_tree(engine: RoundEngine, target: BatchCache, tail: list[int], tree: DraftTree,
                generator: torch.Generator, tested: list[tuple[int, bool]] | None = None) -> tuple[list[int], int, list[int]]:
    """One target forward over `tail` and every node (module docstring, step 2): (the accepted path's nodes, the
    token after them, the target slots of the tail and of the path's nodes in order). `tested`, when given,
    receives (node, accepted) for every node the walk checked."""
    base, first = target.length(0), target.mask.shape[1]  # the tail and the nodes take the slots from `first` on
    tail_slots = list(range(first, first + len(tail)))
    node_slot = [first + len(tail) + i for i in range(len(tree.nodes))]
    sees = ([tail_slots[:i] for i in range(len(tail))]
            + [tail_slots + [node_slot[a] for a in tree.path(i)[:-1]] for i in range(len(tree.nodes))])
    positions = list(range(base, base + len(tail))) + [base + len(tail) + n.depth - 1 for n in tree.nodes]
    logits, _, _ = target.feed_tree(tail + [n.token for n in tree.nodes], positions, sees, logits_from=len(tail) - 1)
    row_of = {-1: 0, **{i: 1 + i for i in range(len(tree.nodes))}}  # rows of `logits`, which start at the tail's last
    at, path = -1, []
    while True:
        logp = engine.transform.log_probs(logits[row_of[at]])
        children = tree.children(at)
        if not children:
            token = draw(logp, generator)
            break
        accepted, token = verify_siblings(logp, [(tree.nodes[c].token, tree.nodes[c].proposal) for c in children],
                                          generator)
        if tested is not None:
            tested += [(child, k == accepted) for k, child in enumerate(children[: len(children) if accepted is None
                                                                                 else accepted + 1])]
        if accepted is None:
            break
        at = children[accepted]
        path.append(at)
    return path, token, tail_slots + [node_slot[i] for i in path]


@torch.no_grad()
def decode_tree(engine: RoundEngine, prompts: list[list[int]], rule: TreeRule, max_new_tokens: int, seeds: list[int],
                head: AcceptanceHead | None = None, checked: list[tuple[int, float, bool]] | None = None
                ) -> list[DecodeResult]:
    """Each prompt decoded alone (B = 1) with tree drafts under `rule`; the counts are those of `RoundEngine.decode`
    (`drafted`: the tree's nodes; `draft_forwards`: the draft's forwards, a tree forward counting once).
    `checked`, when given, receives (its place among its siblings, 1-based; its score; accepted) for every node the
    target checked."""
    rule.check_head(head)
    head = head if rule.reads_head else None
    results = []
    for prompt, seed in zip(prompts, seeds):
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        draft, target = BatchCache(engine.draft, 1, head.state_layer if head else None), BatchCache(engine.target, 1)
        for name, cache in (("draft", draft), ("target", target)):
            if not cache.plain_layers():
                raise UsageError(f"tree drafts need a {name} whose KV cache is one tensor per layer: a tree mask would "
                                 "bypass its sliding-window or recurrent layers; decode this pair with a chain rule")
        drafter = TreeDrafter(engine, rule, head, generator)
        tokens, generated, result = list(prompt), [], DecodeResult(tokens=[])
        while len(generated) < max_new_tokens:
            room = max_new_tokens - len(generated)
            tree = drafter.grow(draft, tokens[draft.length(0):], min(rule.budget, room - 1))  # the last slot: the target's token
            tested: list[tuple[int, bool]] = []
            path, token, target_slots = verify_tree(engine, target, tokens[target.length(0):], tree, generator, tested)
            if checked is not None:
                checked += [(tree.children(tree.nodes[i].parent).index(i) + 1, tree.nodes[i].score, ok) for i, ok in tested]
            standing, emitted, ended = engine._standing([tree.nodes[i].token for i in path], len(path), token, room)
            target.hold(0, target_slots[: len(target_slots) - len(path) + standing])
            read = [tree.nodes[i].draft_slot for i in path[:standing]]
            draft.hold(0, read[: next((k for k, slot in enumerate(read) if slot is None), len(read))])
            for cache in (draft, target):
                cache.trim()
            engine._count(result, rule, len(tree.nodes), standing, called=True)
            tokens += emitted
            generated += emitted
            if ended:
                break
        result.tokens, result.emitted = generated, len(generated)
        result.draft_forwards = draft.forwards[0]
        result.seconds = time.perf_counter() - start
        result.time_forwards(draft, target)
        results.append(result)
    return results

