"""Sibling-aware tree values: the second-child batches a sibling head trains on, its per-depth calibration, training
it, and trees that score their later siblings with it (exact, and the sibling head is what scores them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_args
from sklearn.linear_model import LogisticRegression
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.decoding import RoundEngine
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.heads import OnTimeAcceptanceHead
from specheads.heads.calibration import sigmoid
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


@pytest.fixture(scope="module")
def sibling_data(tiny_model, prompts_file, tmp_path_factory):
    from specheads.cli import main

    out = tmp_path_factory.mktemp("siblings") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, out, "--sibling_labels", "true", "--samples-per-prompt", "3")) == 0
    return out


def test_second_children_batches_carry_the_second_childs_candidate_signal_labels_and_weight(sibling_data, trained):
    from specheads.dataset.datamodule import AcceptanceDataModule

    batches = {}
    for children in ("first", "second"):
        data = AcceptanceDataModule(str(sibling_data), val_fraction=0.3, children=children)
        data.setup()
        batches[children] = next(iter(data.ordered_batches("train", with_features=True, rows_per_batch=64)))
    first, second = batches["first"], batches["second"]
    rows = AcceptanceDataModule(str(sibling_data), val_fraction=0.3)
    rows.setup()
    table = rows.splits["train"].with_format("numpy")[:64]
    for index in range(len(second["valid"])):
        n = len(table["accept"][index])
        ids = table["sibling_ids"][index]
        assert torch.equal(second["valid"][index, :n], torch.from_numpy(ids >= 0))
        assert torch.equal(second["draft_ids"][index, :n], torch.from_numpy(np.maximum(ids, 0)))
        for column, source in (("accept", "sibling_accept"), ("logq", "sibling_logq"), ("beta", "sibling_beta")):
            assert torch.allclose(second[column][index, :n], torch.from_numpy(table[source][index]).float()), column
    assert torch.allclose(second["q"], second["logq"].exp())  # the derived signal follows the second child
    assert torch.allclose(second["first_accept"], first["accept"])
    assert torch.allclose(second["child_weight"][second["valid"]], 1 - first["accept"][second["valid"]])
    assert torch.equal(second["features"], first["features"])  # the same draft state scores both children
    with pytest.raises(UsageError, match="no second-child labels .*--sibling_labels true"):
        AcceptanceDataModule(str(trained[0]), children="second")


def test_positions_without_a_second_child_are_left_out_of_a_batch():
    """q one-hot at a position leaves no second child (−1): the position is not valid, its candidate id is no index
    error, and its weight still reads the first child's acceptance."""
    from specheads.dataset.datamodule import collate_rows, second_children

    def row(ids, first):
        n = len(ids)
        return second_children({"prompt_id": "p", "prompt_ids": np.arange(3), "mixed_ids": np.arange(n),
                                "draft_ids": np.full(n, 7), "is_draft": np.ones(n, dtype=bool), "accept": np.array(first),
                                "beta": np.full(n, 0.5), "logp": np.zeros(n), "logq": np.full(n, -0.1),
                                "entropy": np.ones(n), "top1": np.full(n, 0.9), "sibling_ids": np.array(ids),
                                "sibling_accept": np.array([0.3] * n), "sibling_beta": np.array([0.4] * n),
                                "sibling_logq": np.array([-2.0 if i >= 0 else 0.0 for i in ids])})

    batch = collate_rows([row([5, -1, 9], [0.2, 1.0, 0.6]), row([4, 8], [0.5, 0.1])])
    assert batch["valid"].tolist() == [[True, False, True], [True, True, False]]
    assert batch["draft_ids"].tolist() == [[5, 0, 9], [4, 8, 0]]
    assert torch.allclose(batch["child_weight"], torch.tensor([[0.8, 0.0, 0.4], [0.5, 0.9, 0.0]]))
    assert torch.allclose(batch["logq"][batch["valid"]], torch.full((4,), -2.0))


def test_second_children_need_a_head_a_tree_can_use_and_untruncated_sampling(sibling_data, tmp_path, capsys):
    import json
    import shutil
    from pathlib import Path

    from specheads.cli import main
    from specheads.dataset.datamodule import AcceptanceDataModule

    config = Path(__file__).parents[1] / "configs" / "train" / "specdecpp.yaml"  # reads the state after the candidate
    assert main(["train", "fit", "--config", str(config), "--data.path", str(sibling_data), "--data.children", "second",
                 "--data.val_fraction", "0.3", "--trainer.default_root_dir", str(tmp_path / "run"),
                 "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1"]) != 0
    assert "data.children: second trains a head of a tree's later siblings" in capsys.readouterr().err
    truncated = tmp_path / "top-p"
    shutil.copytree(sibling_data, truncated)
    manifest = json.loads((truncated / "manifest.json").read_text())
    manifest["identity"]["sampling"]["top_p"] = 0.9
    (truncated / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match="sampled with top-k/top-p"):
        AcceptanceDataModule(str(truncated), children="second")


def test_the_sibling_calibration_of_depth_k_is_the_weighted_fit_of_the_second_children_a_tree_reaches_there():
    """Depth k's map is the logistic fit of the second children's labels at the last position of every run of k
    drafted positions, weighted by Π first_accept before it × (1 − first_accept) there (checked against sklearn)."""
    from specheads.heads.calibration_fit import fit_sibling_calibration

    rng = np.random.default_rng(0)
    rows, length = 400, 6
    row = np.repeat(np.arange(rows), length)
    position = np.tile(np.arange(length), rows)
    logits = rng.normal(0, 1.5, rows * length)
    first = rng.uniform(0, 1, rows * length)
    # the label depends on the first children's acceptance there and just before, so the weights change the fit
    before = np.where(position > 0, np.roll(first, 1), 0.5)
    accept = sigmoid(1.5 * logits - 1.0 + 2.0 * (first - 0.5) + 2.0 * (before - 0.5))
    calibration = fit_sibling_calibration(logits, accept, first, row, position, 3)
    for k in (1, 2, 3):
        last = np.flatnonzero(position >= k - 1)
        weight = (1 - first[last]) * np.prod([first[last - j] for j in range(1, k)], axis=0)
        x = np.concatenate([logits[last], logits[last]])[:, None]
        y = np.concatenate([np.ones(len(last)), np.zeros(len(last))])
        fit = LogisticRegression(C=1e6, tol=1e-10, max_iter=1000).fit(
            x, y, sample_weight=np.concatenate([weight * accept[last], weight * (1 - accept[last])]))
        assert calibration.scale[k - 1] == pytest.approx(fit.coef_[0, 0], abs=2e-3)
        assert calibration.bias[k - 1] == pytest.approx(fit.intercept_[0], abs=2e-3)
    assert calibration.bias[0] != pytest.approx(calibration.bias[2], abs=0.05)  # deeper, the tree's reach differs
    # a feature drafter's data: the runs are its rounds (depths 1..k), not any k drafted positions in a row
    depth = np.tile([1, 2, 3, 1, 2, 3], rows)
    rounds = fit_sibling_calibration(logits, accept, first, row, position, 3, depth)
    for k in (2, 3):
        last = np.flatnonzero(depth == k)
        weight = (1 - first[last]) * np.prod([first[last - j] for j in range(1, k)], axis=0)
        x = np.concatenate([logits[last], logits[last]])[:, None]
        fit = LogisticRegression(C=1e6, tol=1e-10, max_iter=1000).fit(
            x, np.concatenate([np.ones(len(last)), np.zeros(len(last))]),
            sample_weight=np.concatenate([weight * accept[last], weight * (1 - accept[last])]))
        assert rounds.scale[k - 1] == pytest.approx(fit.coef_[0, 0], abs=2e-3)
        assert rounds.bias[k - 1] == pytest.approx(fit.intercept_[0], abs=2e-3)
        assert rounds.bias[k - 1] != pytest.approx(calibration.bias[k - 1], abs=1e-3)


def test_a_sibling_head_trains_records_its_children_and_is_refused_as_a_chain_head(sibling_data, tiny_model, tmp_path,
                                                                                      monkeypatch, capsys):
    from pathlib import Path

    from specheads.artifacts.checkpoint import load_trained
    from specheads.cli import main
    from specheads.decoding import make_policy
    from specheads.pair.models import ModelSpec, load_pair
    from specheads.train import module

    fits, original = [], module.fit_sibling_calibration
    monkeypatch.setattr(module, "fit_sibling_calibration", lambda *args: fits.append(args) or original(*args))

    config = Path(__file__).parents[1] / "configs" / "train" / "sibling-ontime.yaml"
    root = tmp_path / "sibling"
    assert main(["train", "fit", "--config", str(config), "--data.path", str(sibling_data), "--data.val_fraction", "0.3",
                 "--data.calibration_fraction", "0.3", "--data.batch_size", "4", "--model.calibrate_positions", "2",
                 "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
                 "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1"]) == 0
    trained = load_trained(str(root / "checkpoints" / "last.ckpt"))
    assert trained.children == "second" and trained.head.calibration.positions == 2
    assert trained.role == trained.head.role == "sibling"  # recorded in the checkpoint, and on the module
    # from Python too: the chain rule refuses the checkpoint's head before any forward
    pair = load_pair(ModelSpec(path=str(tiny_model)), ModelSpec(path=None, skip_layers=[2]))
    engine = RoundEngine(pair.target, pair.draft, SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="the head rule takes .* is a sibling head"):
        engine.decode([[5, 6, 7]], make_policy("head", 0.5), 4, [0], trained.head)
    assert fits and all(len(args[2]) == len(args[0]) for args in fits)  # the per-depth fit, with the first children
    capsys.readouterr()
    assert main(["eval", "--head", str(root / "checkpoints" / "last.ckpt"), "--data", str(sibling_data),
                 "--out", str(tmp_path / "eval")]) != 0
    assert "is a sibling head (trained on a tree's second children)" in capsys.readouterr().err


def test_the_loss_of_second_children_weighs_each_by_how_often_a_tree_checks_it():
    from specheads.train.module import AcceptanceModule

    module = AcceptanceModule(head="specdecpp_ontime", hidden_size=8, head_args={"depth": 0})
    module.build(8, 0)
    generator = torch.Generator().manual_seed(0)
    batch = {"features": torch.randn(2, 5, 8, generator=generator), "valid": torch.ones(2, 4, dtype=torch.bool),
             "is_draft": torch.ones(2, 4, dtype=torch.bool), "accept": torch.rand(2, 4, generator=generator),
             "draft_ids": torch.zeros(2, 4, dtype=torch.long)}
    plain, _ = module.objective(batch)
    weight = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    only_first, _ = module.objective({**batch, "child_weight": weight})
    alone, _ = module.objective({**{k: v[:1, :1] for k, v in batch.items()},
                                 "features": batch["features"][:1, :2]})
    assert float(only_first) == pytest.approx(float(alone)) and float(only_first) != pytest.approx(float(plain))


def sibling_head() -> OnTimeAcceptanceHead:
    """A random on-time head unlike test_tree's `at_draft_head`, biased low as a second child's acceptance is."""
    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "entropy"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(head.out.weight, std=1.0)
    torch.nn.init.constant_(head.out.bias, -1.0)
    head.set_role("sibling")  # as training on second children records it
    return head


@pytest.mark.parametrize("cost_ratio", [None, 0.2])
def test_trees_with_a_sibling_head_sample_the_target_distribution_and_it_scores_the_later_siblings(cost_ratio):
    from test_tree import at_draft_head

    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    rule = TreeRule("head", 0.0 if cost_ratio else 0.15, 5, 3, 2, cost_ratio=cost_ratio)
    runs, checked = 500, []
    chain, siblings = at_draft_head(), sibling_head()
    results = decode_tree(engine, [PROMPT] * runs, rule, LENGTH, list(range(runs)), chain, checked,
                          sibling_head=siblings)
    p_value = chi_square_p([tuple(r.tokens) for r in results], sequence_probabilities(target, SamplingTransform(1.0)))
    assert p_value > 1e-3
    assert any(place > 1 and accepted for place, _, accepted in checked)
    # the same seeds without the sibling head: the later siblings score lower; a run's first child scores alike
    plain: list = []
    decode_tree(engine, [PROMPT] * 40, rule, LENGTH, list(range(40)), chain, plain)
    later = [score for place, score, _ in checked if place > 1]
    assert later and np.mean(later) < np.mean([score for place, score, _ in plain if place > 1]) - 0.05
    for seed in range(5):
        alone, without = [], []
        decode_tree(engine, [PROMPT], rule, LENGTH, [seed], chain, alone, sibling_head=siblings)
        decode_tree(engine, [PROMPT], rule, LENGTH, [seed], chain, without)
        assert alone[0][0] == without[0][0] == 1 and alone[0][1] == without[0][1]


def test_a_sibling_head_is_refused_where_it_cannot_score():
    from test_tree import at_draft_head

    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="sibling head scores a head-valued tree"):
        decode_tree(engine, [PROMPT], TreeRule("confidence", 0.1, 4), 4, [0], None, sibling_head=sibling_head())
    with pytest.raises(UsageError, match="draft's best tokens"):
        decode_tree(engine, [PROMPT], TreeRule("head", 0.1, 4, children="top"), 4, [0], at_draft_head(),
                    sibling_head=sibling_head())
    other = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "entropy"], candidate_embedding_size=16,
                                 state_layer=1)
    other.set_role("sibling")
    with pytest.raises(UsageError, match="reads the draft's state at layer 1"):
        decode_tree(engine, [PROMPT], TreeRule("head", 0.1, 4), 4, [0], at_draft_head(), sibling_head=other)


def test_the_offline_sibling_comparison_reads_a_feature_drafters_rounds_from_depth():
    """benchmarks/sibling_values.py on a drafter's data: depth k's second children are the ends of rounds at depths
    1..k (`depth`), not of any k drafted positions in a row, as the trees and the calibration read them."""
    from types import SimpleNamespace

    from conftest import load_benchmark

    bench = load_benchmark("sibling_values")
    rng = np.random.default_rng(1)
    rows, length = 40, 6
    n = rows * length
    head = SimpleNamespace(calibration=None)
    tokens = {"heads": {"chain": head, "sibling": head}, "logits": {"chain": rng.normal(size=n), "sibling": rng.normal(size=n)},
              "label": rng.uniform(size=n), "confidence": rng.uniform(size=n), "first": rng.uniform(size=n),
              "group": np.repeat(np.arange(rows) // 4, length), "row": np.repeat(np.arange(rows), length),
              "position": np.tile(np.arange(length), rows), "depth": np.tile([1, 2, 1, 2, 3, 1], rows), "prompts": 10}
    config = bench.Config(data="d", head="h", sibling_head="s", depths=3, resamples=20)
    rounds = bench.compare(tokens, config)["depths"]
    assert [row["second_children"] for row in rounds] == [3 * rows, 2 * rows, rows]  # the positions at depth k
    rows_anywhere = bench.compare({**tokens, "depth": None}, config)["depths"]
    assert [row["second_children"] for row in rows_anywhere] == [n, 5 * rows, 4 * rows]


SELF_SPECULATIVE = ("target minus layers 20-21", {"draft": {"derived_from_target": True, "skip_layers": [20, 21]}})
EAGLE3 = ("EAGLE-3 runs/eagle3/drafter", {"draft": {"kind": "eagle3", "folder": "runs/eagle3/drafter"}})


@pytest.mark.parametrize("eagle3, head, refused", [
    (True, SELF_SPECULATIVE, "not of the EAGLE-3 drafter in "),
    (None, EAGLE3, "not of the draft model target minus layers 20-21")])
def test_tree_drafts_refuse_a_head_of_the_other_draft_before_loading_a_model(eagle3, head, refused, tmp_path):
    """benchmarks/tree_drafts.py drafts with the self-speculative draft or --eagle3's drafter; a head that read the
    other one's state is refused in one line before any model loads (the drafter folder holds no model)."""
    from types import SimpleNamespace

    from conftest import load_benchmark

    bench = load_benchmark("tree_drafts")
    if eagle3:
        eagle3 = tmp_path / "drafter"
        eagle3.mkdir()
    config = bench.Config(step="confirm", head="h.ckpt", eagle3=eagle3 and str(eagle3))
    with pytest.raises(SystemExit, match=f"tree_drafts.py: h.ckpt: it read the state of {head[0]}, {refused}"):
        bench.round_engine(config, [SimpleNamespace(source="h.ckpt", draft=head[0], data_identity=head[1])])


def test_tree_drafts_refuse_to_mix_records_of_another_draft_into_a_folder(tmp_path):
    """A folder whose records another draft decoded is refused before decoding more into it (records written
    before the field count as the self-speculative draft's)."""
    import json

    from conftest import load_benchmark

    bench = load_benchmark("tree_drafts")
    (tmp_path / "old.json").write_text(json.dumps({"setting": {}, "records": []}))
    bench.check_drafted_by(tmp_path / "old.json", bench.drafted_by(bench.Config()))
    eagle3 = {"kind": "eagle3", "folder": "d", "weights_sha256": "0" * 16}
    with pytest.raises(SystemExit, match="old.json was drafted by {'kind': None}"):
        bench.check_drafted_by(tmp_path / "old.json", eagle3)
