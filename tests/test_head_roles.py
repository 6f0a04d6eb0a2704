"""A head records what it was trained on (its role: chain stop, expected acceptance, sibling, verifier) in config.json
and on the module, and every consumer refuses, from Python and before any forward, a head in the wrong place: a
sibling head as a chain or tree head, a SPRINTER verifier as a tree head, an expected-acceptance head as a sibling
head. A head exported before roles were recorded gets the role its purpose and training children imply."""

import json
from pathlib import Path

import pytest
import torch
from test_eval import PROMPT, tiny_lm
from test_generate_refusals import counted

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.heads import ExpectedAcceptanceHead, LinearVerifier, OnTimeAcceptanceHead, load_head
from specheads.heads.loading import HEAD_FORMAT, HEAD_FORMAT_VERSION, STOP_RULE, VERIFY_RULE, DecisionRule
from specheads.integrations.transformers import speculative_generate
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 8}


def on_time(role: str | None = None) -> OnTimeAcceptanceHead:
    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq"], candidate_embedding_size=16).eval()
    if role:
        head.set_role(role)
    return head


def expected(role: str | None = None) -> ExpectedAcceptanceHead:
    head = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy"]).eval()
    if role:
        head.set_role(role)
    return head


def saved(folder: Path, head, rule: DecisionRule, **fields) -> Path:
    """`head` saved as `specheads export` writes it (config plus format, rule and sampling), with `fields` over it."""
    head.save_pretrained(folder, config={**head.config, "format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION,
                                         "decision_rule": rule.as_dict(), "sampling": GREEDY, **fields})
    return folder


@pytest.fixture(scope="module")
def engine():
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    return RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])


def test_the_role_is_recorded_in_config_json_and_on_the_loaded_head_and_derived_for_older_folders(tmp_path):
    stop = DecisionRule(STOP_RULE, 0.5, True, max_draft=4)
    folder = saved(tmp_path / "sibling", on_time("sibling"), stop)
    assert json.loads((folder / "config.json").read_text())["role"] == "sibling"
    head, _ = load_head(str(folder))
    assert head.role == "sibling" and head.trained_for["role"] == "sibling" and head.trained_for["role_recorded"]
    # exported before roles were recorded: derived from its purpose and the children it was trained on
    older = {"role": None, "training_data": {"split": {"children": "second"}}}
    for name, made, children, role in (("old-sibling", on_time(), "second", "sibling"),
                                       ("old-chain", on_time(), None, "chain_stop"),
                                       ("old-verifier", LinearVerifier(16), None, "verifier")):
        rule = stop if role != "verifier" else DecisionRule(VERIFY_RULE, 0.5, True)
        folder = saved(tmp_path / name, made, rule, **{**older, "training_data": {"split": {"children": children}}
                                                         if children else {}})
        config = json.loads((folder / "config.json").read_text())
        config.pop("role")
        (folder / "config.json").write_text(json.dumps(config))
        head, _ = load_head(str(folder))
        assert (head.role, head.trained_for["role_recorded"]) == (role, False)
    # a role the class cannot have is refused, naming the field
    config = json.loads((tmp_path / "sibling" / "config.json").read_text())
    (tmp_path / "sibling" / "config.json").write_text(json.dumps({**config, "role": "verifier"}))
    with pytest.raises(UsageError, match="says role \"verifier\", and a specdecpp_ontime head can be chain_stop or sibling"):
        load_head(str(tmp_path / "sibling"))


def test_wrong_heads_are_refused_from_python_before_any_forward(engine):
    forwards = counted(engine.draft), counted(engine.target)
    tree = TreeRule("head", 0.1, 4)
    costs = ServingCosts(CostCurve((1, 2), (1.0, 1.5)), CostCurve((1, 2), (1.0, 1.5)))
    refusals = [
        (lambda: engine.decode([PROMPT], make_policy("head", 0.5), 4, [0], on_time("sibling")),
         "the head rule takes a chain stop head .* this specdecpp_ontime head is a sibling head"),
        (lambda: engine.decode([PROMPT], make_policy("head_cost", 0.2), 4, [0], on_time("sibling")),
         "the head_cost rule takes .* is a sibling head"),
        (lambda: engine.decode([PROMPT], make_policy("head", 0.5), 4, [0], LinearVerifier(16)),
         "the head rule takes .* is a SPRINTER verifier"),
        (lambda: engine.decode([PROMPT], make_policy("sprinter", 0.5), 4, [0], on_time()),
         "the sprinter rule takes a SPRINTER verifier; this specdecpp_ontime head is a chain stop head"),
        (lambda: engine.decode([PROMPT], make_policy("budget", 0.1, max_draft=3), 4, [0], expected("sibling"),
                               costs=costs), "the budget rule takes .* is a sibling head"),
        (lambda: decode_tree(engine, [PROMPT], tree, 4, [0], on_time("sibling")),
         "a head-valued tree's head= takes .* is a sibling head"),
        (lambda: decode_tree(engine, [PROMPT], tree, 4, [0], LinearVerifier(16, candidate_embedding_size=16)),
         "a head-valued tree's head= takes .* is a SPRINTER verifier"),
        (lambda: decode_tree(engine, [PROMPT], tree, 4, [0], on_time(), sibling_head=expected()),
         "decode_tree's sibling_head= takes a sibling head .* this expected_acceptance head is an expected-acceptance"),
        (lambda: decode_tree(engine, [PROMPT], tree, 4, [0], on_time(), sibling_head=on_time()),
         "decode_tree's sibling_head= takes a sibling head .* is a chain stop head"),
    ]
    for call, message in refusals:
        with pytest.raises(UsageError, match=message) as refused:
            call()
        assert "\n" not in str(refused.value)
    assert forwards == ([], [])
    # each in its place decodes
    assert decode_tree(engine, [PROMPT], tree, 4, [0], on_time(), sibling_head=on_time("sibling"))[0].tokens
    assert decode_tree(engine, [PROMPT], tree, 4, [0], expected())[0].tokens


def test_generate_refuses_a_sibling_head(engine):
    target, draft = engine.target, engine.draft
    with pytest.raises(UsageError, match="speculative_generate's head= takes .* is a sibling head"):
        target.generate(torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False, custom_generate=speculative_generate,
                        draft=draft, head=(on_time("sibling"), DecisionRule(STOP_RULE, 0.5, True, max_draft=3)))


def test_a_sibling_head_scores_only_second_children():
    """Third and later siblings keep the chain head's scores (no data labels them): a sibling head of constant score
    gives exactly that score to every second child and to no later one."""
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    sibling = on_time("sibling")
    with torch.no_grad():
        sibling.out.weight.zero_()
        sibling.out.bias.fill_(-2.0)
    constant = float(torch.sigmoid(torch.tensor(-2.0)))
    checked: list = []
    decode_tree(engine, [PROMPT] * 30, TreeRule("head", 0.0, 6, 3, 2), 6, list(range(30)), on_time(), checked,
                sibling_head=sibling)
    second = [score for place, score, _ in checked if place == 2]
    later = [score for place, score, _ in checked if place > 2]
    assert second and later
    assert all(score == pytest.approx(constant, abs=1e-6) for score in second)
    assert not any(score == pytest.approx(constant, abs=1e-6) for score in later)
