"""`load_head` on hostile or odd input: one-line refusals for a config.json that is not UTF-8, not flat enough to
parse, or of the wrong types; sizes beyond their bounds and weights that do not fit the config refused before any
module is built; a shipped head's name that a folder of the working directory cannot shadow; an empty name, a `~`
path and names the Hub would not accept, answered for what they are (not as unreachable Hub ids)."""

import json
import math
import shutil
from pathlib import Path

import pytest

from specheads.export.card import render_card
from specheads.heads import OnTimeAcceptanceHead, load_head
from specheads.heads.base import AcceptanceHead
from specheads.heads.loading import HEAD_FORMAT, HEAD_FORMAT_VERSION, STOP_RULE, DecisionRule, shipped_heads
from specheads.lookup.proposers import Proposal
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError


@pytest.fixture
def folder(tmp_path) -> Path:
    """An on-time head saved as `specheads export` writes it (state layer 1)."""
    head = OnTimeAcceptanceHead(8, depth=1, extra_features=["logq"], candidate_embedding_size=4, state_layer=1)
    out = tmp_path / "head"
    head.save_pretrained(out, config={**head.config, "format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION,
                                      "decision_rule": DecisionRule(STOP_RULE, 0.5, True, max_draft=4).as_dict(),
                                      "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}})
    return out


def rewrite(folder: Path, text: str | bytes | None = None, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    data = text if text is not None else json.dumps({**config, **changes})
    (folder / "config.json").write_bytes(data if isinstance(data, bytes) else data.encode())


@pytest.mark.parametrize("text, changes, message", [
    ("{\"head_type\": \"sp\xe9cdecpp_ontime\"}".encode("latin-1"), {}, r"is not UTF-8 text \(byte 17: invalid continuation byte\)"),
    ("[" * 100_000 + "]" * 100_000, {}, "nests its JSON deeper than Python parses"),
    (None, {"head_type": ["specdecpp_ontime"]}, r"head_type must be a name \(a string\), got \[\"specdecpp_ontime\"\]"),
    (None, {"hidden_size": "8"}, r"hidden_size must be a whole number in \[1, 65536\], got \"8\""),
    (None, {"draft": ["x"]}, r"draft must be an object, got \[\"x\"\]"),
    (None, {"target": "x"}, "target must be an object"),
    (None, {"extra_features": "logq"}, "extra_features must be a list of signal names"),
    (None, {"sampling": {"temperature": "1.0"}}, "sampling's temperature, top_k and top_p must be numbers"),
    (None, {"decision_rule": {"rule": STOP_RULE, "threshold": 0.5, "tuned": True, "cost_ratio": "0.2"}},
     r"the decision rule's cost_ratio must be in \(0, 1\), got '0.2'"),
])
def test_malformed_configs_are_refused_in_one_line(folder, text, changes, message):
    rewrite(folder, text, **changes)
    with pytest.raises(UsageError, match=message) as refused:
        load_head(str(folder))
    assert "\n" not in str(refused.value) and str(folder) in str(refused.value)


@pytest.mark.parametrize("changes, message", [
    ({"depth": 1_000_000}, r"depth must be a whole number in \[0, 64\], got 1000000"),
    ({"hidden_size": 10**9}, r"hidden_size must be a whole number in \[1, 65536\]"),
    ({"candidate_embedding_size": 10**7}, r"candidate_embedding_size must be a whole number in \[0, 65536\]"),
    ({"depth": 3}, r"the weights do not fit config\.json \(hidden_size 8, depth 3\): missing blocks\.1\.bias"),
    ({"hidden_size": 12}, r"shaped blocks\.0\.bias \[\d+\] \(config: \[\d+\]\)"),
])
def test_sizes_beyond_bounds_or_the_weights_are_refused_before_any_module_is_built(folder, monkeypatch, changes,
                                                                                     message):
    rewrite(folder, **changes)
    built = []
    monkeypatch.setattr(AcceptanceHead, "_from_pretrained", classmethod(lambda cls, **kwargs: built.append(kwargs)))
    with pytest.raises(UsageError, match=message):
        load_head(str(folder))
    assert built == []


def test_a_shipped_heads_name_wins_over_a_folder_of_that_name_read_as_a_path(folder, tmp_path, monkeypatch):
    assert "smollm2-ontime" in shipped_heads()
    shutil.copytree(folder, tmp_path / "smollm2-ontime")
    monkeypatch.chdir(tmp_path)
    assert load_head("smollm2-ontime")[0].state_layer == 20  # the shipped head
    assert load_head("./smollm2-ontime")[0].state_layer == 1  # the folder, given as a path


def test_empty_home_relative_and_invalid_names_are_refused_for_what_they_are(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(folder)  # an empty name must not load the working directory's head
    with pytest.raises(UsageError, match=r"no head given \(''\)"):
        load_head("")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_head("~/head")[0].state_layer == 1  # `~` is expanded
    for name, message in (("~/missing", f"{tmp_path}/missing does not exist"),
                          ("a/..", "no valid Hub repo id"), ("org/na me", "no valid Hub repo id")):
        with pytest.raises(UsageError, match=message) as refused:
            load_head(name)
        assert "Hub cannot be used" not in str(refused.value) and "\n" not in str(refused.value)


def test_the_card_states_the_counted_speedup_not_specdecpp_eq_5_1(folder):
    """The shipped card and a freshly rendered one name the speedup the report counted, tokens emitted / (c · draft
    forwards + target calls), or say that none was measured; never SpecDec++ Eq. 5.1."""
    shipped = (shipped_heads()["smollm2-ontime"] / "README.md").read_text()
    assert "Eq. 5.1" not in shipped and "no modelled speedup" in shipped
    config = {**json.loads((folder / "config.json").read_text()), "draft": {"name": "d"}, "target": {"name": "t"}}
    without = str(render_card({**config, "metrics": {"auc": 0.7}}, [], False))
    counted = str(render_card({**config, "metrics": {"modelled_speedup": 1.5, "t_draft_over_t_target": 0.2,
                                                     "speedup_from": "tokens emitted / (c · draft forwards + target calls)"}},
                              [], False))
    assert "Eq. 5.1" not in without + counted and "no modelled speedup" in without
    assert "The modelled speedup is tokens emitted / (c · draft forwards + target calls)" in counted



def test_the_card_names_a_base_model_only_for_a_hub_id(tmp_path, monkeypatch):
    """`base_model` names the Hub id the data's model was loaded by (`plumbing.hub.is_hub_id`, as everywhere), never
    a home-relative path, an id the Hub refuses or a local folder of that shape."""
    from specheads.export.card import hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama").mkdir(parents=True)
    assert hub_id({"path": "HuggingFaceTB/SmolLM2-135M-Instruct"}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id({"path": "embedded:smollm2"}) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for path in ("~/llama", "org/na me", "models/llama", "/abs/llama", "./x/y", None):
        assert hub_id({"path": path}) is None, path


@pytest.mark.parametrize(("name", "kind", "other"), [("smollm2-lookup", "lookup", "suffix"),
                                                      ("smollm2-suffix", "suffix", "lookup")])
def test_the_shipped_token_heads_load_for_their_draft_kind_only_and_rate_a_long_copy_above_a_weak_guess(name, kind,
                                                                                                     other):
    head = TokenHead.load(shipped_heads()[name], kind)
    tokens = tuple(range(5, 13))
    long_copy = Proposal(tokens=tokens, match_length=24, match_count=3, distance=40, scores=(1.0,) * 8,
                         source="output", copy_length=24)
    weak_guess = Proposal(tokens=tokens, match_length=1, match_count=1, distance=900, scores=(0.05,) * 8,
                          source="prompt", copy_length=1)
    sure, unsure = head.estimates(long_copy), head.estimates(weak_guess)
    assert all(0.0 <= a <= 1.0 for a in sure + unsure)
    # what each head learned: a long verbatim copy is accepted whole, a weak guess of 8 tokens much less often
    assert math.prod(sure) > math.prod(unsure) + 0.4
    with pytest.raises(UsageError, match=f"trained on '{kind}' drafts"):
        TokenHead.load(shipped_heads()[name], other)
