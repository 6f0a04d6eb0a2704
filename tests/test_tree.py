"""Tree drafts: the tree mask's cache, recursive rejection sampling, exactness under sampling, greedy identity, and the
chain as the tree of width 1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.decoding import BatchCache, RoundEngine, make_policy
from specheads.decoding.sampler import verify_siblings
from specheads.decoding.tree import TreeDrafter, TreeRule, decode_tree
from specheads.heads import OnTimeAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_lm(seed=1), tiny_lm(seed=2)


def at_draft_head() -> OnTimeAcceptanceHead:
    """A random on-time head (at_draft) whose scores vary with the state and the candidate."""
    torch.manual_seed(3)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "entropy"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(head.out.weight, std=1.0)
    return head


def test_a_tree_forward_gives_each_node_the_logits_of_its_own_path_and_holds_the_accepted_one(tiny_pair):
    """Nodes fed together through the tree mask see only their ancestors; after `hold` the path is the row's sequence
    and the next token's logits equal a fresh forward over it."""
    target, _ = tiny_pair
    cache = BatchCache(target, 1)
    cache.feed({0: [0, 1, 2]})
    # tail [1], then a tree: a=2 (child of the root), b=0 (child of the root), c=1 (child of a)
    first = cache.mask.shape[1]
    logits, _, slots = cache.feed_tree([1, 2, 0, 1], [3, 4, 4, 5], [[], [first], [first], [first, first + 1]])
    for row, path in ((1, [1, 2]), (2, [1, 0]), (3, [1, 2, 1])):
        fresh = target(torch.tensor([[0, 1, 2] + path])).logits[0, -1].float()
        assert torch.allclose(logits[row], fresh, atol=1e-5), path
    cache.hold(0, [slots[0], slots[2]])  # the path 1, 0
    cache.trim()
    after, _ = cache.feed({0: [2]})[0]
    fresh = target(torch.tensor([[0, 1, 2, 1, 0, 2]])).logits[0, -1].float()
    assert cache.length(0) == 6 and torch.allclose(after[-1], fresh, atol=1e-5)


def test_nodes_the_draft_reads_together_each_see_their_own_path(tiny_pair):
    """The draft reads up to `expand` nodes per forward: each node's q equals a fresh forward over its own path."""
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    cache = BatchCache(draft, 1)
    tree = TreeDrafter(engine, TreeRule("confidence", floor=0.0, budget=12, width=3, expand=3), None,
                       torch.Generator().manual_seed(0)).grow(cache, list(PROMPT), depth_cap=4)
    read = [i for i in tree.opened if i >= 0]
    assert len(tree.nodes) == 12 and cache.passes < len(read) + 1  # some forward read several nodes
    for index in read:
        path = [tree.nodes[i].token for i in tree.path(index)]
        fresh = draft(torch.tensor([PROMPT + path])).logits[0, -1].float()
        assert torch.allclose(tree.opened[index].logits, fresh, atol=1e-5), path


@pytest.mark.parametrize("kinds", ["drawn", "chosen", "mixed"])
def test_recursive_rejection_sampling_returns_the_target_distribution(kinds: str):
    """Siblings drawn from q without replacement, tokens chosen outright, or both: the position's token follows p."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    counts = np.zeros(5)
    runs = 6000
    for _ in range(runs):
        left, candidates = q.log(), []
        for index in range(3):
            if kinds == "chosen" or (kinds == "mixed" and index == 2):
                token = [0, 4, 1][index]
                if any(t == token for t, _ in candidates):
                    continue
                candidates.append((token, None))
                left[token] = -float("inf")
            else:
                token = int(torch.multinomial(left.exp(), 1, generator=generator))
                candidates.append((token, left.clone()))
                left[token] = -float("inf")
            left = left.log_softmax(-1)
        accepted, token = verify_siblings(p.log(), candidates, generator)
        counts[candidates[accepted][0] if accepted is not None else token] += 1
    expected = p.double().numpy()
    assert chisquare(counts, expected / expected.sum() * runs).pvalue > 1e-3


def sampled_trees(tiny_pair, rule: TreeRule, runs: int = 500):
    """`runs` decodes of PROMPT under tree `rule` on the tiny pair at T = 1 (a head-valued rule reads `at_draft_head`):
    the results, every sibling test (place, value, accepted) and the chi-square p-value of the sequences against the
    target's exact distribution."""
    target, draft = tiny_pair
    transform = SamplingTransform(1.0)
    engine = RoundEngine(target, draft, transform, stop_ids=[])
    checked: list[tuple[int, float, bool]] = []
    results = decode_tree(engine, [PROMPT] * runs, rule, LENGTH, list(range(runs)),
                          at_draft_head() if rule.values == "head" else None, checked)
    return results, checked, chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, transform))


@pytest.mark.parametrize(("values", "children"), [("confidence", "sampled"), ("head", "sampled"), ("confidence", "top")])
def test_trees_sample_the_target_distribution(tiny_pair, values: str, children: str):
    """Trees whose shape follows the values (up to 3 children a node, 5 nodes, a floor that prunes), with children
    drawn or taken as q's best tokens, decode the target's distribution, and their shapes do vary."""
    results, checked, p_value = sampled_trees(tiny_pair, TreeRule(values, 0.15, 5, 3, 2, children))
    sizes = [size for r in results for size in r.drafted_per_round]
    assert p_value > 1e-3
    assert any(place > 1 and accepted for place, _, accepted in checked)  # later siblings were checked and stood
    assert len(set(sizes)) > 2
    assert max(sizes) > LENGTH or values == "head"  # confidence: wider than a chain could be in some rounds
    assert all(r.emitted == LENGTH and r.target_calls == len(r.accepted_per_round) for r in results)


def greedy_setup() -> tuple[RoundEngine, list[int], list[int]]:
    """A greedy engine on a tiny pair whose draft is close to the target but not equal, a prompt and the target's 16
    argmax tokens after it."""
    target, draft = tiny_lm(seed=1, vocab=40, init=0.5), tiny_lm(seed=1, vocab=40, init=0.5)
    with torch.no_grad():
        draft.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    prompt, expected = [0, 1, 2, 2, 1], []
    with torch.no_grad():
        for _ in range(16):
            expected.append(int(target(torch.tensor([prompt + expected])).logits[0, -1].argmax()))
    return RoundEngine(target, draft, SamplingTransform(0.0), stop_ids=[]), prompt, expected


def test_a_greedy_tree_decodes_the_targets_greedy_tokens():
    """Under greedy decoding (children: the draft's top tokens) the output is the target's argmax chain, with several
    candidates accepted in some rounds."""
    engine, prompt, expected = greedy_setup()
    for values, head in (("confidence", None), ("head", at_draft_head())):
        result = decode_tree(engine, [prompt], TreeRule(values, floor=0.0, budget=6, width=2), 16, [0], head)[0]
        assert result.tokens == expected, values
        assert max(result.accepted_per_round) > 1 and result.drafted_per_round[0] == 6  # floor 0: the budget filled


def test_the_tree_of_width_one_is_the_chain_with_the_heads_stop_rule(tiny_pair):
    """Floor 1 − h and width 1: the same tokens and the same counts as SpecDec++'s stop rule at h."""
    target, draft = tiny_pair
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head = at_draft_head()
    prompts, seeds = [PROMPT, [2, 2, 0, 1]] * 5, list(range(10))
    chain = [engine.decode_one(prompt, make_policy("head", 0.6, max_draft=4), 10, seed, head)
             for prompt, seed in zip(prompts, seeds)]
    tree = decode_tree(engine, prompts, TreeRule("head", floor=0.4, budget=4, width=1), 10, seeds, head)
    for a, b in zip(chain, tree):
        assert (a.tokens, a.accepted_per_round, a.drafted_per_round, a.draft_forwards) == (
            b.tokens, b.accepted_per_round, b.drafted_per_round, b.draft_forwards)
    assert len({d for r in tree for d in r.drafted_per_round}) > 1


def test_bad_tree_settings_are_refused_in_one_line():
    with pytest.raises(UsageError, match="values must be one of"):
        TreeRule("oracle", 0.1, 8)
    with pytest.raises(UsageError, match="budget must be at least 1"):
        TreeRule("confidence", 0.1, 0)
    with pytest.raises(UsageError, match="needs an acceptance head"):
        TreeRule("head", 0.1, 8).check_head(None)
    from transformers import Gemma2Config, Gemma2ForCausalLM

    sliding = Gemma2ForCausalLM(Gemma2Config(vocab_size=3, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4))
    with pytest.raises(UsageError, match="one tensor per layer"):  # a tree mask would bypass the window
        decode_tree(RoundEngine(sliding, sliding, SamplingTransform(1.0), []), [[0, 1]], TreeRule("confidence", 0.1, 4),
                                                                               3, [0])


def test_the_sibling_label_is_what_recursive_rejection_sampling_accepts_after_the_drafted_candidate():
    """Brute force against gen's `sibling_labels`: Σ min(p₂, q₂) enumerated by hand; the second children drawn are
    q without the candidate; and the decoder's sampler, fed those children after the candidate, accepts them as
    often as their labels say once the candidate was rejected."""
    from specheads.data_gen.labels import sibling_labels

    p = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05], dtype=torch.float64)
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2], dtype=torch.float64)
    drafted, runs = 0, 8000
    left = [max(a - b, 0.0) for a, b in zip(p.tolist(), q.tolist())]
    p_rest = [x / sum(left) for x in left]
    q_rest = [0.0 if v == drafted else x / (1 - q[drafted].item()) for v, x in enumerate(q.tolist())]
    by_hand = sum(min(a, b) for a, b in zip(p_rest, q_rest))
    generator = torch.Generator().manual_seed(1)
    second, accept, beta, logq = sibling_labels(p.log().expand(runs, -1), q.log().expand(runs, -1), torch.full((runs,), drafted),
                                                torch.rand(runs, generator=generator, dtype=torch.float64))
    assert torch.allclose(beta, torch.tensor(by_hand, dtype=torch.float64)) and (second != drafted).all()
    assert torch.equal(logq, q.log()[second])  # the child's signal under the whole q, as a tree scores it
    counts = torch.bincount(second, minlength=5).double().numpy()
    assert chisquare(counts[1:], np.array(q_rest[1:]) * runs).pvalue > 1e-3
    rest = torch.tensor(q_rest, dtype=torch.float64).log()
    rejected = accepted = 0
    for x2 in second.tolist():
        outcome, _ = verify_siblings(p.log(), [(drafted, q.log()), (x2, rest)], generator)
        rejected += outcome != 0
        accepted += outcome == 1
    expected = float(accept.mean())
    assert abs(accepted / rejected - expected) < 4 * math.sqrt(expected * (1 - expected) / rejected)
    assert abs(expected - by_hand) < 0.03  # the labels of the drawn children average to Σ min(p₂, q₂)


def test_gen_labels_a_second_child_on_its_own_stream(tiny_model, prompts_file, tmp_path):
    """`--sibling_labels true` adds the sibling columns and leaves every other column as it was."""
    from conftest import tiny_args

    from specheads.cli import main
    from specheads.data_gen.config import GenConfig, SamplingConfig
    from specheads.dataset.store import load_labelled, read_manifest

    for name, extra in (("plain", ()), ("siblings", ("--sibling_labels", "true"))):
        assert main(tiny_args(tiny_model, prompts_file, tmp_path / name, "--store_features", "false", *extra)) == 0
    plain, siblings = load_labelled(tmp_path / "plain"), load_labelled(tmp_path / "siblings")
    for column in ("mixed_ids", "draft_ids", "accept", "beta"):
        assert plain[column] == siblings[column], column
    assert read_manifest(tmp_path / "siblings")["identity"]["sibling_labels"] is True
    for row in siblings:
        assert len(row["sibling_ids"]) == len(row["draft_ids"]) == len(row["sibling_accept"])
        assert all(s != d for s, d in zip(row["sibling_ids"], row["draft_ids"]) if s >= 0)
        assert all(0 <= a <= 1 and 0 <= b <= 1 for a, b in zip(row["sibling_accept"], row["sibling_beta"]))
        # q(x₂) and q(ŷ) are two tokens of one distribution; no second child, no signal
        assert all(math.exp(s) + math.exp(d) <= 1 + 1e-5 if i >= 0 else s == 0
                   for i, s, d in zip(row["sibling_ids"], row["sibling_logq"], row["logq"]))
        assert any(s < 0 for s in row["sibling_logq"])
    with pytest.raises(UsageError, match="at temperature 0 q is one-hot"):
        GenConfig(sibling_labels=True, sampling=SamplingConfig(temperature=0.0)).validate()
