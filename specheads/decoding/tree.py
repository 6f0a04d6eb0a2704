"""Tree drafts: a token tree whose shape the values decide, verified exactly in one target forward (several requests'
trees in one forward with `decode_tree(..., batch_size=B)`).

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
3. **accept**: the accepted path and that token, ended at a stop token and max_new_tokens; both caches hold the path;
4. **account**: the round into the request's counts and its growth's history (`TreeDecode.round` runs the four).

Exact (docs/method.md, "Tree drafts"): every drawn child came from its q_i, and whether a slot was filled was settled
from what was known before its draw (values of earlier nodes, never the child's own token), so each sibling test is
a valid speculative-sampling step; nodes chosen rather than drawn (greedy) are exact whatever chose them. A value
that reads a drawn token decides only its descendants and later siblings, never whether that token is verified —
the budget's trap (ranking drawn tokens by a score that read them) is not open here.

**Sibling-aware values** (`decode_tree(..., sibling_head=)`): a head trained on a tree's second children
(`data.children: second`, docs/method.md "Sibling-aware values") scores the second children, the chain head the first
children and, as without a sibling head, the third and later ones (no data labels those). The second child is checked
against the residual p₂ = norm(max(0, p − q)), where the chain label overstates it; its score sets the reach past it
and its value. It reads the sibling's own token, as the chain head reads a first child's: a score decides only
descendants and later siblings, so exactness is as above.

With `width` 1 the tree is the chain: the slot rule is SpecDec++'s stop rule (draft on while Π â ≥ floor = 1 − h),
and a head-valued tree of width 1 decodes token for token what `HeadStop(h)` decodes.

**Growth that weighs its costs** (`cost_ratio` c = t_draft/t_target given; docs/method.md "Trees whose growth weighs
their costs"). Each step takes the action of highest gain in E[R − ρ·T] (`specheads.decoding.cost_rule`), if it pays:
- fill a slot of reach r, the j-th child of its node: gain r·μ_j − ρ·(c·h + Δv), where Δv is what one more token adds
  to the target's forward on the cost curve in use (0 on the flat curve) and c·h the head's forward that scores the
  child (h = `head_forward_cost` of the head scoring that place; 0 for confidence values, which the draft already
  computed: their width is free up to the budget on the flat curve);
- read the unread node of highest value v, in one draft forward: gain v·μ_1 − ρ·(c + c·h + Δv), the forward paid for
  by the first child it opens; the forward also reads up to `expand` − 1 further nodes whose first child pays for its
  own slot (v·μ_1 > ρ·(c·h + Δv)). A block drafter (DSpark) reads its nodes from the round's block without a forward,
  so a read costs what a slot does: v·μ_1 − ρ·(c·h + Δv); its one forward a round is the tail's, and its paths end
  at the block's depth.
μ_j is the mean score of the request's children drawn so far at place j among their siblings (all places when none
is yet at j; 1 before any), ρ the request's realised rate (1 + tokens)/(1 + cost) over its rounds so far (its head's
forwards in the cost); both are known before the slot's draw, so exactness is as above. The floor still applies (0
lets the costs alone decide). With width 1 this is the chain's rule read from the costs (`head_cost`), token for token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specheads.decoding.cache import BatchCache
from specheads.decoding.companion import head_forward_cost
from specheads.decoding.cost_rule import RequestState, drafting_gain, verify_cost, verify_step
from specheads.decoding.costs import CostCurve
from specheads.decoding.engine import (
    RoundEngine,
    StopCheck,
    acceptance_batch,
    candidate_signals,
    check_decodable_head,
    count_head,
    count_round,
    unread_tokens,
)
from specheads.decoding.features import draft_block, draft_candidate_cost, tree_caches
from specheads.decoding.result import DecodeResult
from specheads.decoding.sampler import draw, verify_siblings
from specheads.heads import AcceptanceHead
from specheads.heads.roles import CHAIN_HEADS, SIBLING, check_role
from specheads.model_outputs.signals import signal_log_probs
from specheads.plumbing.errors import UsageError

TREE_VALUES = ("confidence", "head")
TREE_CHILDREN = ("sampled", "top")


@dataclass(frozen=True)
class TreeRule:
    """How a round's tree grows: `values` ("confidence": draft confidence q(x), EAGLE-2's; "head": an acceptance
    head's â), `floor` (the least reach a slot is filled at), `budget` (N, the most nodes the target verifies per
    forward), `width` (most children per node), `expand` (most nodes the draft reads per forward) and `children`
    ("sampled": drawn from q without replacement; "top": q's best tokens, checked as fixed tokens, EAGLE's sampling
    mode; greedy decoding always takes the untempered draft's best tokens). With `cost_ratio` (c = t_draft/t_target)
    the tree grows only where the expected tokens pay for the draft forwards and, on the target's `curve` (flat when
    None), for the target's extra tokens (module docstring)."""

    values: str
    floor: float
    budget: int
    width: int = 4
    expand: int = 4
    children: str = "sampled"
    cost_ratio: float | None = None
    curve: CostCurve | None = None

    name: ClassVar[str] = "tree"

    def __post_init__(self) -> None:
        for knob in ("floor", "cost_ratio"):
            value = getattr(self, knob)
            if not (value is None and knob == "cost_ratio") and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UsageError(f"the tree's {knob} must be a number, got {value!r}")
        for knob in ("budget", "width", "expand"):
            if isinstance(getattr(self, knob), bool) or not isinstance(getattr(self, knob), int):
                raise UsageError(f"the tree's {knob} must be a whole number, got {getattr(self, knob)!r}")
        if self.cost_ratio is not None and not 0.0 < self.cost_ratio < 1.0:
            raise UsageError(f"the tree's cost_ratio is t_draft/t_target, in (0, 1); got {self.cost_ratio}")
        if self.curve is not None and self.cost_ratio is None:
            raise UsageError("a tree's cost curve prices its growth only with cost_ratio=t_draft/t_target; give "
                             "cost_ratio too, or drop curve")
        if self.curve is not None and not isinstance(self.curve, CostCurve):
            raise UsageError(f"the tree's curve must be a CostCurve (specheads.decoding.costs), got "
                             f"{type(self.curve).__name__}; build one with CostCurve.from_dict")
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

    @property
    def weighs_costs(self) -> bool:
        """Whether growth weighs what a level and a slot cost (a `cost_ratio` is given)."""
        return self.cost_ratio is not None

    def check_head(self, head: AcceptanceHead | None, sibling_head: AcceptanceHead | None = None) -> None:
        """Refuse a head the tree cannot score children with, and a sibling head it cannot use beside it."""
        if sibling_head is not None and not self.reads_head:
            raise UsageError("a sibling head scores a head-valued tree's second children; give the tree values: head "
                             "(and the chain head), or drop sibling_head")
        if not self.reads_head:
            return
        if head is None:
            raise UsageError("a tree with head values needs an acceptance head")
        check_role(head, CHAIN_HEADS, "a head-valued tree's head=")
        if sibling_head is not None:
            check_role(sibling_head, (SIBLING,), "decode_tree's sibling_head=")
        for name, scorer in (("head", head), ("sibling head", sibling_head)):
            refusal = None if scorer is None else child_values_refusal(scorer)
            if refusal:
                fix = "decode chains with it" if getattr(scorer, "markov_rank", 0) else "use an at_draft or before_draw head"
                raise UsageError(f"the {name}: {refusal}; {fix}")
        if sibling_head is not None and sibling_head.state_layer != head.state_layer:
            raise UsageError(f"the sibling head reads the draft's state at layer {sibling_head.state_layer} and the "
                             f"head at {head.state_layer}; a tree reads one state per node: train both on data of one "
                             "state layer")


def child_values_refusal(head: AcceptanceHead) -> str | None:
    """Why `head` cannot score a tree's children (None: it can): a tree scores each child from its parent's state
    when the child is drawn, which only a head deciding at the draw or before it does, and feeds it no Markov embedding
    (a head reading a DSpark drafter's: `markov_rank`)."""
    if getattr(head, "markov_rank", 0):
        return (f"a tree feeds a head no DSpark Markov embedding; this {head.head_type} head reads one (markov_rank "
                f"{head.markov_rank})")
    if head.decides in ("at_draft", "before_draw"):
        return None
    return (f"a tree scores each child from its parent's state; a {head.head_type} head decides {head.decides} (it "
            "reads the state after the child)")


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
    widths: list[int] = field(default_factory=list)  # the tokens each draft forward read (the tail's forward: the
    # tail's tokens, its catch-up, the prompt counting as its last token alone; then the nodes each read)
    scored: list[int] = field(default_factory=list)  # the nodes a head scored after each draft forward (head values)
    head_forwards: float = 0.0  # those scores in draft forwards, each at its head's cost (`head_forward_cost`)

    def children(self, index: int) -> list[int]:
        return self.roots if index < 0 else self.nodes[index].children

    def path(self, index: int) -> list[int]:
        """The nodes from the root's child down to `index`."""
        path = []
        while index >= 0:
            path.append(index)
            index = self.nodes[index].parent
        return path[::-1]


@dataclass
class TreeCosts:
    """What cost-aware growth knows of one request (module docstring): its rate so far, ρ, and the scores of the
    children drawn so far by their place among siblings, whose means are μ_j."""

    cost_ratio: float
    curve: CostCurve | None = None  # the target's forward time against its tokens; None: flat
    request: RequestState = field(default_factory=RequestState)
    scores: dict[int, list[float]] = field(default_factory=dict)  # place among siblings (1-based) -> [sum, count]
    head_cost: float = 0.0  # h: the head's forward over one node in draft forwards (0: no head scores)
    sibling_cost: float | None = None  # the sibling head's h, where one scores the second children
    block: bool = False  # a block drafter: the tree's nodes are read from the round's block, without a forward
    candidate: float = 0.0  # m: what the draft computes for each node it reads after its forward, in draft forwards (a
    # DSpark drafter's Markov bias giving the node's children's q)

    def scoring_cost(self, place: int) -> float:
        """c·h: what scoring a node at `place` among its siblings adds, in target forwards (its scorer's h: the
        sibling head's for a second child where one scores it, else the head's)."""
        return self.cost_ratio * (self.sibling_cost if place == 2 and self.sibling_cost is not None else self.head_cost)

    def expected_score(self, place: int) -> float:
        """μ_j: the mean score of the request's children at `place` so far; of all its children when none is at
        `place` yet; 1 before any."""
        if place in self.scores:
            total, count = self.scores[place]
            return total / count
        count = sum(c for _, c in self.scores.values())
        return sum(t for t, _ in self.scores.values()) / count if count else 1.0

    def scored(self, place: int, score: float) -> None:
        """Note a drawn child's score at its place among siblings."""
        entry = self.scores.setdefault(place, [0.0, 0])
        entry[0] += score
        entry[1] += 1

    def slot_gain(self, reach: float, place: int, nodes: int) -> float:
        """What filling a slot of `reach` (the `place`-th child of its node), the tree holding `nodes` nodes, adds to
        E[R − ρ·T]: r·μ_place − ρ·(c·h + Δv), c·h the child's scoring (`scoring_cost`)."""
        return drafting_gain(reach, self.expected_score(place), self.request.rate(), self.scoring_cost(place),
                             verify_step(self.curve, nodes))

    def read_gain(self, value: float, nodes: int) -> float:
        """What reading a node of `value` in a draft forward of its own adds, counting the first child it opens:
        v·μ_1 − ρ·(c + c·h + Δv), c·h the first child's scoring; a block drafter reads it from the round's block,
        without a forward: v·μ_1 − ρ·(c·h + Δv); c·m more where the draft computes more for the node after its forward
        (a DSpark drafter's Markov bias)."""
        forward = (0.0 if self.block else self.cost_ratio) + self.cost_ratio * self.candidate
        return drafting_gain(value, self.expected_score(1), self.request.rate(), forward + self.scoring_cost(1),
                             verify_step(self.curve, nodes))

    def observe(self, accepted: int, draft_forwards: int, nodes: int, head_forwards: float = 0.0) -> None:
        """Add a verified round to ρ: `accepted` nodes and the target's token, for `draft_forwards` draft forwards,
        `head_forwards` draft forwards' worth of head scores (`DraftTree.head_forwards`) and a target forward over the
        tail and `nodes` nodes."""
        self.request.tokens += accepted + 1
        self.request.cost += self.cost_ratio * (draft_forwards + head_forwards) + verify_cost(self.curve, nodes)


def scoring_costs(engine: RoundEngine, head: AcceptanceHead | None, sibling_head: AcceptanceHead | None) -> dict[int, float]:
    """Each scoring head's forward over one node in draft forwards (`head_forward_cost`), keyed by the head's id."""
    return {id(h): head_forward_cost(h, engine.draft) for h in (head, sibling_head) if h is not None}


class TreeDrafter:
    """Grows one round's tree from the draft's cache (module docstring, step 1); one drafter serves one request, whose
    history cost-aware growth reads (`costs`, None without a `cost_ratio`)."""

    def __init__(self, engine: RoundEngine, rule: TreeRule, head: AcceptanceHead | None, generator: torch.Generator,
                 sibling_head: AcceptanceHead | None = None, head_costs: dict[int, float] | None = None):
        self.engine, self.rule, self.head, self.generator = engine, rule, head, generator
        self.sibling_head = sibling_head  # scores the second children when given (module docstring)
        self.transform = engine.transform
        self.fixed = engine.transform.greedy or rule.children == "top"  # children chosen, not drawn
        self.head_costs = scoring_costs(engine, head, sibling_head) if head_costs is None else head_costs
        self.costs = None if rule.cost_ratio is None else TreeCosts(
            rule.cost_ratio, rule.curve, head_cost=self.head_costs.get(id(head), 0.0),
            sibling_cost=None if sibling_head is None else self.head_costs[id(sibling_head)],
            block=draft_block(engine.draft) is not None, candidate=draft_candidate_cost(engine.draft))

    def grow(self, draft: BatchCache, tail: list[int], depth_cap: int, priced: int = 1) -> DraftTree:
        """The tree after the context's `tail` (tokens the draft has not read; it reads them and holds them), with
        paths of at most `depth_cap` nodes (none at 0: the target's token alone fills the last slot); `priced`, the
        tail's tokens its first forward is priced on (`engine.unread_tokens`: the prefill left out)."""
        if depth_cap < 1:
            return DraftTree()
        logits, states = draft.feed({0: tail})[0]
        tree = DraftTree(widths=draft.round_widths(priced, 1), scored=[0])
        opened = tree.opened
        opened[-1] = self._open(logits[-1], states[-1], 1.0, [])
        while len(tree.nodes) < self.rule.budget:
            unread = sorted((i for i, n in enumerate(tree.nodes)
                             if i not in opened and n.depth < depth_cap and n.token not in self.engine.stop_ids
                             and n.value >= self.rule.floor),
                            key=lambda i: -tree.nodes[i].value)
            slots = [(index, o.reach) for index, o in opened.items() if self._has_room(tree, index, o)]
            step = self._weighed(tree, unread, slots) if self.costs is not None else self._by_floor(tree, unread, slots)
            if step is None:
                break
            if isinstance(step, list):
                self._read(draft, tree, opened, step)
            else:
                self._fill(tree, opened, step)
        return tree

    def _by_floor(self, tree: DraftTree, unread: list[int], slots: list[tuple[int, float]]) -> list[int] | int | None:
        """The next step by reach alone: read the best unread nodes when the best of them is worth more than every
        slot, else fill the slot of highest reach while it is at least the floor (None: the tree is done)."""
        slot = max(slots, key=lambda item: item[1], default=(None, -1.0))
        if unread and tree.nodes[unread[0]].value > slot[1]:
            return unread[: self.rule.expand]
        if slot[0] is None or slot[1] < self.rule.floor:
            return None
        return slot[0]

    def _weighed(self, tree: DraftTree, unread: list[int], slots: list[tuple[int, float]]) -> list[int] | int | None:
        """The next step by its gain in E[R − ρ·T] (module docstring), when it pays: a read (the nodes to read) or a
        slot (its node); None when neither pays."""
        assert self.costs is not None
        nodes = len(tree.nodes)
        gains = [(self.costs.slot_gain(reach, len(tree.children(index)) + 1, nodes), index) for index, reach in slots
                 if reach >= self.rule.floor]
        slot_gain, slot = max(gains, key=lambda gain: gain[0], default=(0.0, None))
        read_gain = self.costs.read_gain(tree.nodes[unread[0]].value, nodes) if unread else 0.0
        if read_gain > 0 and (slot is None or read_gain > slot_gain):
            riders = [i for i in unread[1:] if self.costs.slot_gain(tree.nodes[i].value, 1, nodes) > 0]
            return [unread[0], *riders[: self.rule.expand - 1]]
        return slot if slot is not None and slot_gain > 0 else None

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
        base, forwards = draft.length(0), draft.forwards[0]
        sees = [opened[tree.nodes[i].parent].sees + ([] if tree.nodes[i].parent < 0 else
                                                     [tree.nodes[tree.nodes[i].parent].draft_slot]) for i in chosen]
        logits, states, slots = draft.feed_tree([tree.nodes[i].token for i in chosen],
                                                [base + tree.nodes[i].depth - 1 for i in chosen], sees)
        if draft.forwards[0] > forwards:  # a block drafter reads its block's nodes without a forward
            tree.widths.append(len(chosen))
            tree.scored.append(0)
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
        logq = at.logq
        if self.fixed and not math.isfinite(float(logq[token])):  # a greedy tree's later child: one-hot q gives it 0
            logq = signal_log_probs(at.logits, logq, self.transform)  # so its signals read the untempered draft
        signals = candidate_signals(at.logits, logq, token, self.transform)
        score = self._score(at, signals, token, depth, len(siblings) + 1)
        if self.head is not None:  # one head forward over this child, counted after the draft's latest forward
            tree.scored[-1] += 1
            tree.head_forwards += self.head_costs[id(self._scorer(len(siblings) + 1))]
        score = min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0
        if self.costs is not None:
            self.costs.scored(len(siblings) + 1, score)
        tree.nodes.append(Node(token, parent, depth, proposal, score, at.reach * score))
        siblings.append(len(tree.nodes) - 1)
        at.reach *= 1.0 - score

    def _score(self, at: Opened, signals: dict[str, float], token: int, depth: int, place: int) -> float:
        """The child's score: the head's â (the sibling head's for a second child, `place` 2, when there is one: it
        was trained on second children only), or its draft confidence; for a fixed child, its confidence over the mass
        the earlier siblings left (the chance it is the target's token once they were not), so that a node's value is
        Π q along its path, EAGLE-2's value."""
        if self.head is not None:
            head = self._scorer(place)
            return acceptance_batch(head, [at.state], [signals], [self.engine.candidate_embedding(head, token)],
                                    [depth])[0]
        if not self.fixed:
            return signals["prob"]
        score = signals["prob"] / max(1.0 - at.taken, 1e-9)
        at.taken += signals["prob"]
        return score

    def _scorer(self, place: int) -> AcceptanceHead:
        """The head that scores a child at `place` among its siblings: the sibling head for a second child when there
        is one (it was trained on second children only), else the head."""
        return self.sibling_head if place == 2 and self.sibling_head is not None else self.head


def verify_trees(engine: RoundEngine, target: BatchCache, rounds: dict[int, tuple[list[int], DraftTree, torch.Generator]],
                 tested: dict[int, list[tuple[int, bool]]] | None = None) -> dict[int, tuple[list[int], int, list[int]]]:
    """One target forward over each row's `tail` and every node of its tree (module docstring, step 2; `rounds`:
    row -> (tail, tree, the row's generator)): per row, (the accepted path's nodes, the token after them, the target
    slots of the tail and of the path's nodes in order). `tested[row]`, when given, receives (node, accepted) for
    every node the row's walk checked."""
    fed, node_slots = {}, {}
    for row, (tail, tree, _) in rounds.items():
        base, first = target.length(row), target.mask.shape[1]  # the tail and the nodes take the slots from `first` on
        tail_slots = list(range(first, first + len(tail)))
        node_slots[row] = [first + len(tail) + i for i in range(len(tree.nodes))]
        sees = ([tail_slots[:i] for i in range(len(tail))]
                + [tail_slots + [node_slots[row][a] for a in tree.path(i)[:-1]] for i in range(len(tree.nodes))])
        positions = list(range(base, base + len(tail))) + [base + len(tail) + n.depth - 1 for n in tree.nodes]
        fed[row] = (tail + [n.token for n in tree.nodes], positions, sees)
    outputs = target.feed_trees(fed, {row: len(tail) - 1 for row, (tail, _, _) in rounds.items()})
    walks = {}
    for row, (tail, tree, generator) in rounds.items():
        logits, _, slots = outputs[row]
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
                tested.setdefault(row, []).extend(
                    (child, k == accepted) for k, child in enumerate(children[: len(children) if accepted is None
                                                                              else accepted + 1]))
            if accepted is None:
                break
            at = children[accepted]
            path.append(at)
        walks[row] = (path, token, slots[: len(tail)] + [node_slots[row][i] for i in path])
    return walks


@dataclass
class ForwardShare:
    """A request's share of a shared cache's timed forwards, as `DecodeResult.time_forwards` reads a cache."""

    forward_seconds: float = 0.0
    passes: float = 0.0


@dataclass
class TreeRequest:
    """One request while it holds a row of a batched tree decode: its own draft cache (B = 1) and drafter, its
    generator, tokens and counts."""

    index: int
    tokens: list[int]
    generator: torch.Generator
    draft: BatchCache
    drafter: TreeDrafter
    generated: list[int] = field(default_factory=list)
    result: DecodeResult = field(default_factory=lambda: DecodeResult(tokens=[]))
    seconds: float = 0.0  # its share of the decode's wall time: each round's, split equally among the rows in it
    target: ForwardShare = field(default_factory=ForwardShare)  # its share of the target's forwards



@dataclass
class TreeDecode:
    """One tree decode in progress: the pair, the rule and the heads that value its nodes (`head_costs`: each one's
    forward in draft forwards, by id), the target cache the rows share, the maker of each request's own draft cache,
    and where each round's output goes (`decode_tree`'s arguments of the same names)."""

    engine: RoundEngine
    rule: TreeRule
    head: AcceptanceHead | None
    sibling_head: AcceptanceHead | None
    head_costs: dict[int, float]
    target: BatchCache
    draft_cache: Callable[[int, int | None], BatchCache]
    max_new_tokens: int
    checked: list[tuple[int, float, bool]] | None = None
    stop_check: StopCheck | None = None
    on_emit: Callable[[int, list[int]], None] | None = None

    def admit(self, rows: list[TreeRequest | None], waiting: list[int], prompts: list[list[int]], seeds: list[int]) -> None:
        """Give each free row the next waiting request (`waiting` is popped from its end), with a fresh draft cache."""
        for row, held in enumerate(rows):
            if held is None and waiting:
                index = waiting.pop()
                generator = torch.Generator().manual_seed(seeds[index])
                self.target.crop_row(row, 0)
                draft = self.draft_cache(row, self.head.state_layer if self.head else None)
                rows[row] = TreeRequest(index, list(prompts[index]), generator, draft,
                                        TreeDrafter(self.engine, self.rule, self.head, generator, self.sibling_head,
                                                    self.head_costs))

    def round(self, active: dict[int, TreeRequest]) -> list[int]:
        """One round of every active row (module docstring): draft each row's tree, verify them all in one target
        forward, then accept and account row by row; the rows whose requests finished."""
        round_start = time.perf_counter()
        drafted = {row: self.draft(request) for row, request in active.items()}
        tested: dict[int, list[tuple[int, bool]]] = {}
        seconds, passes = self.target.forward_seconds, self.target.passes
        walks = verify_trees(self.engine, self.target, {row: (request.tokens[self.target.length(row):], drafted[row][0],
                                                               request.generator) for row, request in active.items()},
                             tested)
        done = []
        for row, request in active.items():
            (tree, forwards), (path, token, target_slots) = drafted[row], walks[row]
            request.target.passes += (self.target.passes - passes) / len(active)
            request.target.forward_seconds += (self.target.forward_seconds - seconds) / len(active)
            if self.checked is not None:
                self.checked.extend((tree.children(tree.nodes[i].parent).index(i) + 1, tree.nodes[i].score, ok)
                                    for i, ok in tested.get(row, []))
            standing, emitted, ended = self.accept(row, request, tree, path, token, target_slots)
            self.account(request, tree, len(path), standing, forwards, emitted)
            if ended or len(request.generated) >= self.max_new_tokens:
                done.append(row)
        spent = (time.perf_counter() - round_start) / len(active)
        for request in active.values():
            request.seconds += spent
        return done

    def draft(self, request: TreeRequest) -> tuple[DraftTree, float]:
        """The request's tree for this round (step 1) and the draft forwards it took, a DSpark drafter's Markov bias
        included (also added to the request's count)."""
        before = request.draft.forwards[0]
        room = self.max_new_tokens - len(request.generated)  # the last slot: the target's token
        tail = request.tokens[request.draft.length(0):]
        rule = self.rule
        depth_cap = (min(rule.budget, room - 1, request.draft.draft_limit() or rule.budget)
                     if request.draft.can_draft(0) else 0)
        # (a feature drafter's first round drafts nothing; a block drafter's paths end at its block)
        tree = request.drafter.grow(request.draft, tail, depth_cap,
                                    unread_tokens(request.tokens, request.draft.length(0), request.generated))
        forwards = request.draft.forwards[0] - before
        # a DSpark drafter's Markov bias: one for each node read (the root too), giving its children's q
        markov = draft_candidate_cost(self.engine.draft) * len(tree.opened)
        request.result.draft_forwards += markov
        return tree, forwards + markov

    def accept(self, row: int, request: TreeRequest, tree: DraftTree, path: list[int], token: int,
               target_slots: list[int]) -> tuple[int, list[int], bool]:
        """What of the verified path stands (ended at a stop token, a stop check or max_new_tokens), both caches held
        to it: (the nodes that stand, the tokens emitted, whether the request ended)."""
        check = None if self.stop_check is None else (
            lambda round_tokens, request=request: self.stop_check(request.index, request.generated + round_tokens))
        room = self.max_new_tokens - len(request.generated)
        standing, emitted, ended = self.engine.round_output([tree.nodes[i].token for i in path], len(path), token, room,
                                                            check)
        self.target.hold(row, target_slots[: len(target_slots) - len(path) + standing])
        read = [tree.nodes[i].draft_slot for i in path[:standing]]
        request.draft.hold(0, read[: next((k for k, slot in enumerate(read) if slot is None), len(read))])
        request.draft.trim()
        return standing, emitted, ended

    def account(self, request: TreeRequest, tree: DraftTree, verified: int, standing: int, forwards: float,
                emitted: list[int]) -> None:
        """The round into the request's counts and its growth's history (`verified`: the nodes of the accepted path),
        and its new tokens into the request and the streamer."""
        count_round(request.result, len(tree.nodes), standing, called=True)
        request.result.draft_widths_per_round.append(list(tree.widths))
        if self.head is not None:
            count_head(request.result, tree.scored, tree.head_forwards, called=True)
        if request.drafter.costs is not None:
            request.drafter.costs.observe(verified, forwards, len(tree.nodes), tree.head_forwards)
        request.tokens += emitted
        request.generated += emitted
        if self.on_emit is not None and emitted:
            self.on_emit(request.index, emitted)


def check_tree_decode(engine: RoundEngine, prompts: list[list[int]], rule: TreeRule, head: AcceptanceHead | None,
                      sibling_head: AcceptanceHead | None, batch_size: int) -> None:
    """Refuse, before any cache or forward, what `decode_tree` cannot decode: a chain rule, a draft of another
    vocabulary, a batch size that is not a whole number from 1, an empty prompt, heads the tree cannot score with."""
    if not isinstance(rule, TreeRule):
        raise UsageError(f"decode_tree takes a TreeRule (specheads.decoding.tree), got {type(rule).__name__}; chain rules "
                         "decode with engine.decode")
    if engine.vocabulary != engine.draft_vocabulary:
        raise UsageError(f"tree drafts need a draft that predicts the target's {engine.vocabulary} tokens; this draft "
                         f"predicts {engine.draft_vocabulary}: decode chains (engine.decode) with it, or pick a draft with "
                         "the target's vocabulary")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"decode_tree's batch_size is the rows decoded together, a whole number from 1; got {batch_size!r}")
    if any(len(prompt) == 0 for prompt in prompts):
        raise UsageError("decode_tree needs at least one token in every prompt (a chat template's, at least); an empty "
                         "prompt has no context to draft from: drop it or give it text")
    check_decodable_head(head)
    check_decodable_head(sibling_head)
    rule.check_head(head, sibling_head)
    if sibling_head is not None and (engine.transform.greedy or rule.children == "top"):
        raise UsageError("a sibling head scores later siblings drawn from q (it was trained on second children drawn "
                         "so); these children are the draft's best tokens (greedy decoding or children: top): drop "
                         "sibling_head")


@torch.no_grad()
def decode_tree(engine: RoundEngine, prompts: list[list[int]], rule: TreeRule, max_new_tokens: int, seeds: list[int],
                head: AcceptanceHead | None = None, checked: list[tuple[int, float, bool]] | None = None,
                stop_check: StopCheck | None = None, on_emit: Callable[[int, list[int]], None] | None = None,
                batch_size: int = 1, sibling_head: AcceptanceHead | None = None) -> list[DecodeResult]:
    """`engine.decode` with tree drafts under `rule`: up to `batch_size` requests at once, their trees verified in
    one target forward (continuous batching: a finished request's row takes the next prompt); each request grows its
    tree with a draft cache of its own, so a row decodes what it decodes alone. The counts are those of
    `RoundEngine.decode` (`drafted`: the tree's nodes; `draft_forwards`: the draft's forwards, a tree forward counting
    once; `head_scored`: every node a head valued, one head forward each). `checked`, when given, receives (its place
    among its siblings, 1-based; its score; accepted) for every node the target checked. `stop_check(request,
    generated)` ends a request after the first token at which it holds, as a stop token does; `on_emit(request,
    tokens)` receives each round's new tokens (a streamer). `sibling_head`, a head trained on second children (role
    `sibling`), scores a head-valued tree's second children (module docstring); `head` must be a chain stop or
    expected-acceptance head (`specheads.heads.roles`)."""
    check_tree_decode(engine, prompts, rule, head, sibling_head, batch_size)
    head = head if rule.reads_head else None
    target, draft_cache = tree_caches(engine.target, engine.draft, min(batch_size, max(len(prompts), 1)))
    for name, cache in (("draft", draft_cache(0, None)), ("target", target)):
        if not cache.plain_layers():
            raise UsageError(f"tree drafts need a {name} whose KV cache is one tensor per layer: a tree mask would "
                             "bypass its sliding-window or recurrent layers; decode this pair with a chain rule")
    results: list[DecodeResult | None] = [DecodeResult(tokens=[]) if max_new_tokens <= 0 else None for _ in prompts]
    waiting = [index for index in range(len(prompts)) if results[index] is None][::-1]
    decode = TreeDecode(engine, rule, head, sibling_head, scoring_costs(engine, head, sibling_head), target, draft_cache,
                        max_new_tokens, checked, stop_check, on_emit)  # the heads' costs, the same for every request
    rows: list[TreeRequest | None] = [None] * len(target.slots)
    while waiting or any(rows):
        decode.admit(rows, waiting, prompts, seeds)
        for row in decode.round({row: request for row, request in enumerate(rows) if request is not None}):
            results[rows[row].index] = finished(rows[row])
            rows[row] = None
            target.crop_row(row, 0)
        target.trim()
    return [result for result in results if result is not None]


def finished(request: TreeRequest) -> DecodeResult:
    """The request's result: its tokens and counts, its own draft forwards, and its shares of the decode's wall time and
    of each batched target forward it took part in (so that shares over the requests add up to the decode's)."""
    result = request.result
    result.tokens, result.emitted = request.generated, len(request.generated)
    result.draft_forwards += request.draft.forwards[0]  # and what was counted round by round after the forwards
    result.seconds = request.seconds
    result.time_forwards(request.draft, request.target)
    return result
