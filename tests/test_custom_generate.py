"""A head from the Hub in one line of transformers: `specheads export` writes custom_generate/ into the head folder, and
`target.generate(..., custom_generate="<folder or org/head>", trust_remote_code=True, draft=draft)` (transformers'
own loader of remote code) decodes the target's greedy output token for token under the head's exported rule."""

import json
import secrets
import shutil
from pathlib import Path

import pytest
import torch
from test_cost_rule import calibrated_on_time_head
from test_integration_transformers import Collect, near_pair

from specheads.artifacts.checkpoint import load_trained
from specheads.cli import main
from specheads.export.run import already_exported, custom_generate_files, head_config, write_folder
from specheads.heads import load_head
from specheads.heads.loading import COST_RULE, STOP_RULE, DecisionRule
from specheads.integrations.transformers import speculative_generate
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

PROMPTS = ([5, 9, 1], [30, 2, 2, 7, 11])
NEW = 20


@pytest.fixture(scope="module")
def pair():
    return near_pair()


def head_folder(folder: Path, rule: DecisionRule) -> Path:
    """An exported greedy on-time head carrying `rule`, as `specheads export` would have read it from eval."""
    calibrated_on_time_head().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(decision_rule=rule.as_dict(), sampling=SamplingTransform(0.0).as_dict())
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def decode(target, draft, ids, custom_generate, **kwargs):
    """generate's output and each row's counted forwards (`stats`)."""
    stats = []
    out = target.generate(ids, do_sample=False, max_new_tokens=NEW, custom_generate=custom_generate, draft=draft,
                          stats=stats, **kwargs)
    return out.tolist(), [(s.drafted, s.target_calls, s.emitted) for s in stats]


def plain_of(target, ids):
    """The target's own greedy output."""
    return target.generate(ids, do_sample=False, max_new_tokens=NEW).tolist()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A head with a tuned threshold, exported by `specheads export` (no report: it keeps its folder's rule)."""
    base = tmp_path_factory.mktemp("custom_generate")
    source = head_folder(base / "source", DecisionRule(STOP_RULE, 0.35, tuned=True, max_draft=4, cost_ratio=0.2))
    out = base / "head"
    assert main(["export", "--ckpt", str(source), "--out", str(out)]) == 0
    return out


def test_export_writes_custom_generate_that_load_head_ignores_and_the_card_names(exported):
    assert sorted(p.relative_to(exported).as_posix() for p in (exported / "custom_generate").iterdir()) == [
        "custom_generate/generate.py", "custom_generate/requirements.txt"]
    assert (exported / "custom_generate" / "requirements.txt").read_text().strip().startswith("specheads>=")
    head, rule = load_head(str(exported))  # the extra folder is neither loaded nor refused
    assert (rule.rule, rule.threshold, rule.max_draft, rule.tuned) == (STOP_RULE, 0.35, 4, True)
    card = (exported / "README.md").read_text()
    assert "custom_generate=\"REPO_OR_FOLDER\", trust_remote_code=True, draft=draft, do_sample=False" in card
    assert "pip install specheads" in card
    # a push retried over a folder written without (or with other) custom_generate files writes it again
    trained = load_trained(str(exported))
    config_json = json.loads((exported / "config.json").read_text())
    code = custom_generate_files(trained.head, rule)
    assert already_exported(exported, trained, config_json, code)
    stale = exported.parent / "stale"
    shutil.copytree(exported, stale)
    (stale / "custom_generate" / "generate.py").write_text("def generate(model, **kwargs): ...\n")
    assert not already_exported(stale, trained, config_json, code)
    shutil.rmtree(stale / "custom_generate")
    assert not already_exported(stale, trained, config_json, code)


def test_the_one_liner_from_a_local_folder_is_the_targets_greedy_under_the_heads_tuned_rule(exported, pair):
    """Through transformers' loader (custom_generate as a string): the target's greedy tokens, and the very rounds
    the exported rule gives through `speculative_generate` with the loaded head."""
    target, draft = pair
    loaded = load_head(str(exported))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        plain = plain_of(target, ids)
        ours, stats = decode(target, draft, ids, str(exported), trust_remote_code=True)
        direct, direct_stats = decode(target, draft, ids, speculative_generate, head=loaded)
        assert ours == plain == direct
        assert stats == direct_stats and stats[0][2] == NEW and 0 < stats[0][1] < NEW  # rounds kept several tokens
        untuned = decode(target, draft, ids, speculative_generate, head=loaded[0])[1]  # the default rule drafts otherwise
        assert untuned[0][0] != stats[0][0]
    # the draft may be given as generate's assistant_model, generate's own streamer= gets the prompt and then every
    # token (transformers hands it to a custom_generate repo), and a head of one's own is refused
    ids = torch.tensor([PROMPTS[0]])
    streamer = Collect()
    ours = decode(target, None, ids, str(exported), trust_remote_code=True, assistant_model=draft, streamer=streamer)[0]
    assert ours == plain_of(target, ids) and streamer.tokens == ours[0] and streamer.ended
    with pytest.raises(UsageError, match="drop head="):
        decode(target, draft, ids, str(exported), trust_remote_code=True, head=loaded)


def test_the_one_liner_runs_the_cost_rule_a_head_carries_and_takes_the_callers_cost_ratio(pair, tmp_path):
    target, draft = pair
    rule = DecisionRule(COST_RULE, 0.2, tuned=False, max_draft=6, cost_ratio=0.2)
    trained = load_trained(str(head_folder(tmp_path / "source", rule)))
    code = custom_generate_files(trained.head, rule)
    out = tmp_path / "head"
    write_folder(out, trained, head_config(trained, rule, {}), [], None, False, code)
    assert "Give your hardware's t_draft/t_target as `cost_ratio=`" in (out / "README.md").read_text()
    loaded = load_head(str(out))
    assert loaded[1].rule == COST_RULE
    ids = torch.tensor([PROMPTS[0]])
    drafted = {}
    for cost_ratio in (None, 0.02, 0.9):
        ours, stats = decode(target, draft, ids, str(out), trust_remote_code=True, cost_ratio=cost_ratio)
        direct, direct_stats = decode(target, draft, ids, speculative_generate, head=loaded, cost_ratio=cost_ratio)
        assert ours == direct == plain_of(target, ids) and stats == direct_stats
        drafted[cost_ratio] = stats[0][0] / stats[0][1]
    assert drafted[0.02] > drafted[0.9]  # cheaper drafting, longer rounds: the cost rule ran at the caller's ratio


def test_the_one_liner_from_a_hub_repo_id_loads_code_and_head_from_the_same_snapshot(exported, pair, tmp_path):
    """`custom_generate="me/my-head"` with the repo in a Hugging Face cache (the tests run offline): transformers
    fetches generate.py from the snapshot, the adapter fetches the head's files from it with the same cache_dir."""
    target, draft = pair
    commit = secrets.token_hex(20)  # transformers keeps a Hub repo's code per commit id: a new id runs this code
    repo = tmp_path / "hub" / "models--me--my-head"
    shutil.copytree(exported, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    ids = torch.tensor([PROMPTS[1]])
    ours, stats = decode(target, draft, ids, "me/my-head", trust_remote_code=True, cache_dir=str(tmp_path / "hub"))
    assert ours == plain_of(target, ids) and 0 < stats[0][1] < NEW


def test_transformers_reads_the_exported_requirements(exported, pair, tmp_path):
    """A requirement the environment does not meet stops transformers before any code of the repo runs."""
    target, draft = pair
    folder = tmp_path / "needs-newer"
    shutil.copytree(exported, folder)
    (folder / "custom_generate" / "requirements.txt").write_text("specheads>=99\n")
    with pytest.raises(ImportError, match=r"specheads>=99 \(installed"):
        decode(target, draft, torch.tensor([PROMPTS[0]]), str(folder), trust_remote_code=True)


def test_the_one_liner_refuses_a_derived_draft_skipping_other_layers_than_the_heads(exported, pair, tmp_path):
    """The repo's generate.py checks a draft derived from the target by the layers it skips, not only their count:
    a head trained for the target minus layer 1 refuses the target minus layer 0, before any forward."""
    from specheads.pair.models import without_layers

    target, _ = pair
    folder = tmp_path / "derived"
    shutil.copytree(exported, folder)
    config = json.loads((folder / "config.json").read_text())
    config["draft"] = {"name": "target minus layers 1", "weights": {"derived_from_target": True, "skip_layers": [1]}}
    (folder / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([PROMPTS[0]])
    assert decode(target, without_layers(target, [1]), ids, str(folder), trust_remote_code=True)[0] == plain_of(target, ids)
    with pytest.raises(UsageError, match=r"it skips the target's layers \[0\], the head was trained for a draft skipping "
                                         r"\[1\]"):
        decode(target, without_layers(target, [0]), ids, str(folder), trust_remote_code=True)
