"""`specheads eval --dspark DIR` / `--eagle3 DIR`: a feature drafter drafts every decoding run (the free rules,
constant K, the oracle, the confidence trees, the serving table), its forwards counted as they run (a DSpark block is
one a round); the rules reading the head, trained on the data's draft's state, are left out with the reason; what the
drafter cannot do is refused in one line before any forward, nothing written."""

import json

import pytest
import torch
from test_eagle3_decoding import randomised
from test_eval import eval_args

from specheads.cli import main

pytest.importorskip("speculators.models.dspark")

from specheads.pair.drafters import fill_from_target, save_drafter  # noqa: E402


def saved_drafter(tiny_model, folder, kind, **settings):
    """A drafter of `kind` over the tiny target's whole vocabulary, random weights, saved to `folder`."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    size = target.config.vocab_size
    if kind == "dspark":
        from specheads.pair.dspark import build_drafter

        drafter = build_drafter(target.config, [1, 2, 3], size, "tiny", mask_token_id=0, block_size=3, markov_rank=4,
                                **settings)
    else:
        from specheads.pair.eagle3 import build_drafter

        drafter = build_drafter(target.config, [1, 2, 3], size, "tiny")
    fill_from_target(drafter, target, torch.zeros(size, dtype=torch.long), torch.ones(size, dtype=torch.bool))
    save_drafter(randomised(drafter, std=0.3), folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module")
def dspark_folder(tiny_model, tmp_path_factory):
    return saved_drafter(tiny_model, tmp_path_factory.mktemp("dspark") / "drafter", "dspark")


def runs_of(out):
    return json.loads((out / "runs.json").read_text())


def test_eval_decodes_the_free_rules_trees_and_serving_table_with_a_dspark_drafter(trained, dspark_folder, tmp_path):
    data, root = trained
    out = tmp_path / "report"
    assert main(eval_args(root / "specdecpp" / "checkpoints" / "last.ckpt", data, out, "--dspark", str(dspark_folder),
                          "--tree-budgets", "[4]", "--tree-floors", "[0.1]", "--serving-batch-sizes", "[2]", "--test-samples", "2",
                          "--serving-batch-policies", "[smartspec, goodput]")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    decoding = metrics["decoding"]
    policies = {row["policy"] for row in decoding["policies"]}
    assert {"constant_k", "confidence", "pmin", "dspark_confidence", "oracle"} <= policies
    assert not policies & {"head", "head_cost", "head_cost_online"}  # the head read the data's draft's state
    assert "not the DSpark drafter's" in decoding["head_left_out"] and decoding["drafter"]["kind"] == "dspark"
    assert "the head's rules were not decoded" in metrics["verdict"]["decoding"]["note"]
    saved = runs_of(out)
    assert saved["context"]["drafter"] == decoding["drafter"] and len(decoding["drafter"]["sha256"]) == 64
    markov = decoding["drafter"]["candidate_cost"]  # each candidate's Markov bias, in block forwards
    assert markov > 0
    for run in saved["runs"]:  # one block forward a round that drafts: never more blocks than target calls
        # a chain's Markov bias runs once a candidate, a tree's once a node it reads (at most its nodes and the root)
        blocks = run["draft_forwards"] - markov * (run["drafted"] + (run["target_calls"] if "tree" in run["policy"] else 0))
        assert blocks <= run["target_calls"] + 1e-6 and all(len(w) <= 1 for w in run["draft_widths_per_round"])
        if run["policy"] == "oracle":
            assert blocks == pytest.approx(sum(1 for a in run["accepted_per_round"] if a))
    trees = decoding["trees"]
    assert {row["policy"] for row in trees["policies"]} == {"tree_confidence_n4", "tree_confidence_cost_n4"}
    assert trees["left_out"]["tree_head"] == decoding["head_left_out"]
    serving = decoding["serving"]
    served = {row["policy"] for row in serving["rows"]}
    assert {"smartspec", "dspark_adaptive", "constant_k"} <= served and "goodput" not in served
    assert serving["left_out"]["goodput"] == decoding["head_left_out"]
    assert "dspark_confidence" not in served and "checks one candidate fewer" in serving["left_out"]["dspark_confidence"]
    assert "drafted with the DSpark drafter" in (out / "report.md").read_text()


def test_eval_decodes_with_an_eagle3_drafter(trained, tiny_model, tmp_path):
    data, root = trained
    folder = saved_drafter(tiny_model, tmp_path / "eagle3", "eagle3")
    out = tmp_path / "report"
    assert main(eval_args(root / "specdecpp" / "checkpoints" / "last.ckpt", data, out, "--eagle3", str(folder))) == 0
    decoding = json.loads((out / "metrics.json").read_text())["decoding"]
    assert {"constant_k", "svip", "oracle"} <= {row["policy"] for row in decoding["policies"]}
    assert "dspark_confidence" not in {row["policy"] for row in decoding["policies"]}
    assert runs_of(out)["context"]["drafter"]["kind"] == "eagle3"
    oracle = [run for run in runs_of(out)["runs"] if run["policy"] == "oracle"]
    assert all(run["draft_forwards"] == run["accepted"] for run in oracle)  # a chain: one forward a kept candidate


def test_what_a_feature_drafter_cannot_do_is_refused_in_one_line_before_any_forward(trained, dspark_folder, tiny_model,
                                                                                     tmp_path, capsys, monkeypatch):
    data, root = trained
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    plain = saved_drafter(tiny_model, tmp_path / "plain", "dspark", confidence_head=False)
    capsys.readouterr()
    cases = [
        (["--dspark", str(dspark_folder), "--eagle3", str(dspark_folder)], "give one of them"),
        (["--dspark", str(tmp_path)], "give the folder of a drafter"),
        (["--dspark", str(dspark_folder), "--sv-companion-skip-layers", "[1]"], "drafts without --sv-companion-skip-layers"),
        (["--dspark", str(dspark_folder), "--prompt-cache-mb", "64"], "drafts without --prompt-cache-mb"),
        (["--serving-batch-sizes", "[1]", "--serving-batch-policies", "[dspark_adaptive]"], "give --dspark DIR"),
        (["--dspark", str(plain), "--serving-batch-sizes", "[1]", "--serving-batch-policies", "[dspark_adaptive]"],
         "reads a DSpark drafter's confidence head, which this draft does not have"),
        # the head and so its --budget-head twin read the data's draft, not the drafter's: the budget could not plan
        (["--dspark", str(dspark_folder), "--serving-batch-sizes", "[1]", "--budget-head", str(head)],
         "--budget-head would plan nothing: the head read the state of the data's draft"),
    ]
    import specheads.eval.run as run

    def no_forward(*args, **kwargs):
        raise AssertionError("a decoding run started")

    monkeypatch.setattr(run, "run_sweep", no_forward)
    monkeypatch.setattr(run, "collect_tokens", no_forward)
    for flags, problem in cases:
        out = tmp_path / "report"
        assert main(eval_args(head, data, out, *flags)) == 2, flags
        error = capsys.readouterr().err.strip()
        assert problem in error and error.count("\n") == 0, error
        assert not out.exists()
    verifier = root / "sprinter" / "checkpoints" / "last.ckpt"
    assert main(eval_args(verifier, data, tmp_path / "report", "--dspark", str(dspark_folder))) == 2
    assert "SPRINTER, whose rounds earn no bonus token" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
