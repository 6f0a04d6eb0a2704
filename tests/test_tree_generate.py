"""Trees in transformers' `generate`: `speculative_generate(..., tree=...)` and `custom_generate="<head folder>"` with
`tree=` decode the target's greedy tokens, sample the target's distribution (chi-square through generate), end where
the target alone ends, and refuse bad tree arguments in one line."""

from __future__ import annotations

import pytest
import torch
from test_custom_generate import head_folder
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities
from test_integration_transformers import Collect, StopAfter, head_for, near_pair, quiet_pair
from test_tree import at_draft_head
from test_tree_growth import LINEAR
from transformers import StoppingCriteriaList

from specheads.cli import main
from specheads.decoding.tree import TreeRule
from specheads.heads.loading import STOP_RULE, DecisionRule
from specheads.integrations.transformers import speculative_generate
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

NEW = 20
TREES = {  # a head-valued tree grown by the costs, one by its floor, and EAGLE-2's confidence tree without a head
    "head, cost-aware": {"values": "head", "floor": 0.0, "budget": 6, "width": 2, "cost_ratio": 0.1},
    "head, floor": TreeRule("head", 0.0, budget=6, width=2),
    "confidence, cost-aware": {"values": "confidence", "floor": 0.0, "budget": 6, "width": 2, "cost_ratio": 0.1,
                               "curve": {"tokens": [1, 64], "seconds": [1.0, 1.5]}},
}


@pytest.fixture(scope="module")
def wide_pair():
    return near_pair()


@pytest.mark.parametrize("name", list(TREES))
def test_a_tree_through_generate_is_the_targets_greedy_and_ends_where_it_ends(wide_pair, name):
    target, draft = wide_pair
    tree = TREES[name]
    head = head_for(SamplingTransform(0.0)) if name.startswith("head") else None
    for prompt in ([5, 9, 1], [30, 2, 2, 7, 11], [4]):
        ids = torch.tensor([prompt])
        plain = target.generate(ids, do_sample=False, max_new_tokens=NEW)
        stats = []
        ours = target.generate(ids, do_sample=False, max_new_tokens=NEW, custom_generate=speculative_generate,
                               draft=draft, head=head, tree=tree, stats=stats)
        assert ours.tolist() == plain.tolist()
        assert stats[0].emitted == NEW and stats[0].target_calls < NEW and max(stats[0].accepted_per_round) > 1
    # left-padded prompts decode each as alone; a stopping criterion and the streamer end where the target ends
    batch, mask = torch.tensor([[0, 0, 5, 9, 1], [30, 2, 2, 7, 11]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    together = target.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=12,
                               custom_generate=speculative_generate, draft=draft, head=head, tree=tree)
    for row, prompt in enumerate(([5, 9, 1], [30, 2, 2, 7, 11])):
        alone = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
        assert together[row, -12:].tolist() == alone[0, -12:].tolist()
    ids = torch.tensor([[5, 9, 1]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=NEW)[0, 3:].tolist()
    first = plain.index(plain[6])
    streamer = Collect()
    ours = target.generate(ids, do_sample=False, max_new_tokens=NEW, custom_generate=speculative_generate, draft=draft,
                           head=head, tree=tree, stopping_criteria=StoppingCriteriaList([StopAfter(plain[6])]),
                           token_streamer=streamer)
    assert ours[0, 3:].tolist() == plain[: first + 1]
    assert streamer.tokens == [5, 9, 1] + plain[: first + 1] and streamer.ended


@pytest.mark.parametrize(("values", "curve"), [("head", LINEAR), ("confidence", None)])
def test_sampling_a_tree_through_generate_leaves_the_target_distribution_unchanged(values, curve):
    """500 samples (5 generate calls of 100 rows) of cost-aware trees (3 wide, 5 nodes; on a linear target curve and
    on the flat one) against the enumerated target."""
    target, draft = quiet_pair()
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    head = at_draft_head() if values == "head" else None
    tree = TreeRule(values, 0.0, budget=5, width=3, expand=2, cost_ratio=0.2, curve=curve)
    torch.manual_seed(0)
    samples, stats = [], []
    for _ in range(5):
        out = target.generate(torch.tensor([PROMPT] * 100), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=LENGTH, custom_generate=speculative_generate, draft=draft, head=head,
                              tree=tree, stats=stats)
        samples += [tuple(row[len(PROMPT):]) for row in out.tolist()]
    assert chi_square_p(samples, exact) > 1e-3
    assert len({size for s in stats for size in s.drafted_per_round}) > 2  # the trees' shapes vary


def test_a_tree_through_the_heads_own_generate_py_is_the_targets_greedy(wide_pair, tmp_path):
    """`custom_generate="<exported head folder>", tree=...`: transformers' loader runs the folder's generate.py, which
    hands the tree on; the head's own chain rule is not used."""
    target, draft = wide_pair
    source = head_folder(tmp_path / "source", DecisionRule(STOP_RULE, 0.35, tuned=True, max_draft=4, cost_ratio=0.2))
    assert main(["export", "--ckpt", str(source), "--out", str(tmp_path / "head")]) == 0
    ids = torch.tensor([[30, 2, 2, 7, 11]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=NEW)
    chain, tree = [], []
    for stats, extra in ((chain, {}), (tree, {"tree": {"values": "head", "floor": 0.0, "budget": 6, "cost_ratio": 0.1}})):
        out = target.generate(ids, do_sample=False, max_new_tokens=NEW, custom_generate=str(tmp_path / "head"),
                              trust_remote_code=True, draft=draft, stats=stats, **extra)
        assert out.tolist() == plain.tolist()
    assert tree[0].drafted_per_round != chain[0].drafted_per_round


@pytest.mark.parametrize(("tree", "extra", "message"), [
    ("wide", {}, "tree= must be a TreeRule"),
    ({"values": "head", "budget": 8}, {}, "tree= lacks floor"),
    ({"values": "head", "floor": 0.1, "budget": 8, "depth": 3}, {}, "tree= has unknown fields depth"),
    ({"values": "head", "floor": 0.1, "budget": "8"}, {}, "budget must be a whole number"),
    ({"values": "confidence", "floor": 0.1, "budget": 8, "cost_ratio": 0.2}, {"cost_ratio": 0.3}, "give it once"),
    ({"values": "confidence", "floor": 0.1, "budget": 8, "curve": {"tokens": [1]}}, {}, "cost curve is"),
    (TreeRule("head", 0.1, 8), {"head": None}, "needs head="),
])
def test_bad_tree_arguments_are_refused_in_one_line(wide_pair, tree, extra, message):
    target, draft = wide_pair
    kwargs = {"head": head_for(SamplingTransform(0.0)), **extra}
    with pytest.raises(UsageError, match=message) as raised:
        target.generate(torch.tensor([[5, 9, 1]]), do_sample=False, max_new_tokens=4,
                        custom_generate=speculative_generate, draft=draft, tree=tree, **kwargs)
    assert "\n" not in str(raised.value)
