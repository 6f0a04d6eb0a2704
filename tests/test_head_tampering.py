"""A head folder whose config.json was edited is refused by `load_head`, naming the field: a head_type that
contradicts the timing the config declares, an unknown format version, a decision rule out of its range; and eval
refuses a --fixed-thresholds value its rule cannot take before anything runs."""

import json
from pathlib import Path

import pytest
import torch

from specheads.cli import main
from specheads.heads import LinearVerifier, OnTimeAcceptanceHead, ResNetAcceptanceHead, load_head
from specheads.heads.loading import HEAD_FORMAT, HEAD_FORMAT_VERSION, STOP_RULE, VERIFY_RULE, DecisionRule
from specheads.plumbing.errors import UsageError


def head_folder(folder: Path, head: torch.nn.Module, rule: DecisionRule) -> Path:
    """`head` saved as `specheads export` writes it: its config plus the format and the decision rule."""
    torch.manual_seed(0)
    with torch.no_grad():
        head.out.weight.normal_()
    head.save_pretrained(folder, config={**head.config, "format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION,
                                         "decision_rule": rule.as_dict()})
    return folder


def edit(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def ontime(tmp_path) -> Path:
    """An on-time head (decides at the draft) with a tuned stop rule."""
    head = OnTimeAcceptanceHead(8, depth=1, extra_features=["logq"], candidate_embedding_size=4)
    return head_folder(tmp_path / "ontime", head, DecisionRule(STOP_RULE, 0.6, True, max_draft=6, cost_ratio=0.2))


def test_an_untouched_head_folder_loads_with_its_rule(ontime):
    head, rule = load_head(str(ontime))
    assert type(head) is OnTimeAcceptanceHead and head.decides == "at_draft"
    assert rule == DecisionRule(STOP_RULE, 0.6, True, max_draft=6, cost_ratio=0.2)


def test_an_on_time_head_relabelled_as_the_lagged_head_is_refused(ontime):
    # the weights fit the lagged class too (same blocks, same input width): only the declared timing tells them apart
    edit(ontime, head_type="specdecpp_resnet")
    with pytest.raises(UsageError, match=r"says head_type 'specdecpp_resnet' but reads 'context_state', decides "
                                         r"'at_draft'.*a specdecpp_resnet head has reads 'candidate_state', decides "
                                         r"'one_step_late'"):
        load_head(str(ontime))


def test_a_lagged_head_relabelled_as_on_time_and_a_verifier_relabelled_are_refused(tmp_path):
    lagged = head_folder(tmp_path / "lagged", ResNetAcceptanceHead(8, depth=1), DecisionRule.untuned("stop"))
    edit(lagged, head_type="specdecpp_ontime")
    with pytest.raises(UsageError, match=r"says head_type 'specdecpp_ontime' but reads 'candidate_state'"):
        load_head(str(lagged))
    edit(lagged, head_type="specdecpp_resnet", decides="at_draft")  # the type back, the timing edited
    with pytest.raises(UsageError, match=r"but decides 'at_draft'"):
        load_head(str(lagged))
    verifier = head_folder(tmp_path / "verifier", LinearVerifier(8), DecisionRule.untuned("verify"))
    edit(verifier, purpose="stop")
    with pytest.raises(UsageError, match=r"but purpose 'stop'"):
        load_head(str(verifier))


@pytest.mark.parametrize("changes, message", [
    ({"format_version": 99}, r"declares head format_version 99, which specheads .* does not read \(it reads 1\); "
                             r"upgrade specheads"),
    ({"format_version": "1"}, r"declares format_version '1', not a version number"),
    ({"format": "other-tool"}, r"declares format 'other-tool', not 'specheads-head'"),
    ({"decision_rule": {"rule": STOP_RULE, "threshold": 7.5, "tuned": True}},
     r"config\.json: the stop_drafting_when_rejection_risk_above threshold must be a number in \[0, 1\], got 7\.5"),
    ({"decision_rule": {"rule": STOP_RULE, "threshold": float("nan"), "tuned": True}}, r"must be a number in \[0, 1\]"),
    ({"decision_rule": {"rule": STOP_RULE, "threshold": 0.5, "tuned": True, "max_draft": 0}},
     r"max_draft must be a whole number >= 1, got 0"),
    ({"decision_rule": {"rule": VERIFY_RULE, "threshold": 0.5, "tuned": True}},
     r"a stop head acts by the rule stop_drafting_when_rejection_risk_above, but decision_rule names "
     r"call_target_when_acceptance_below"),
    ({"decision_rule": {"rule": STOP_RULE, "threshold": 0.5, "tuned": True, "bonus": 1}},
     r"decision_rule is malformed \(.*bonus"),
])
def test_an_edited_format_or_rule_is_refused(ontime, changes, message):
    edit(ontime, **changes)
    with pytest.raises(UsageError, match=message):
        load_head(str(ontime))


def test_eval_and_export_refuse_the_tampered_folder_in_one_line(ontime, tmp_path, capsys):
    edit(ontime, head_type="specdecpp_resnet")
    assert main(["export", "--ckpt", str(ontime), "--out", str(tmp_path / "again")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "says head_type 'specdecpp_resnet'" in error, error
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("thresholds, message", [
    ('{"head": 5.0}', "--fixed-thresholds gives head 5.0, outside its range: head's threshold is a number in [0, 1]"),
    ('{"head": 0.5, "constant_k": 2.5}', "constant_k's threshold is a whole number >= 1"),
    ('{"head": 0.5, "svip": -1}', "svip's threshold is a finite number >= 0"),
])
def test_eval_refuses_a_fixed_threshold_outside_its_rule_range_before_anything_runs(tmp_path, capsys, thresholds,
                                                                                    message):
    out = tmp_path / "report"
    # no head or data exist: the argument check refuses before either is read
    assert main(["eval", "--head", str(tmp_path / "no-head"), "--data", str(tmp_path / "no-data"), "--out", str(out),
                 "--fixed-thresholds", thresholds, "--num-decode-prompts", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error, error
    assert not out.exists()
