"""The on-time head's recipe options: the target's last verified state, DSpark's position weights, the auxiliary α
target and training subsets for learning curves (fast tier, tiny pair)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_args

from specheads.cli import main
from specheads.dataset.datamodule import AcceptanceDataModule
from specheads.dataset.store import load_labelled
from specheads.dataset.targets import stale_target_states
from specheads.plumbing.errors import UsageError
from specheads.train.loss import position_weights, run_positions, weighted_bce

CONFIGS = Path(__file__).parents[1] / "configs" / "train"


def test_run_positions_count_the_drafted_tokens_since_the_last_target_token_and_weigh_them_as_dspark():
    is_draft = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0, 1]]).bool()
    assert run_positions(is_draft).tolist() == [[1, 2, 0, 1, 2, 3, 0, 0, 1]]
    weights = position_weights(torch.tensor([1, 2, 3]), gamma=2.0)
    assert torch.allclose(weights, torch.exp(-torch.tensor([0.0, 0.5, 1.0])))
    logits, labels = torch.tensor([0.3, -1.0, 2.0]), torch.tensor([1.0, 0.2, 0.6])
    # weights that are all equal leave the loss unchanged; a zero weight drops the token
    assert torch.isclose(weighted_bce(logits, labels, weights=torch.full((3,), 0.5)), weighted_bce(logits, labels))
    assert torch.isclose(weighted_bce(logits, labels, weights=torch.tensor([1.0, 1.0, 0.0])),
                         weighted_bce(logits[:2], labels[:2]))


def test_the_stale_target_state_is_the_row_k_before_the_context_state_and_k_is_cut_to_the_stored_rows():
    features = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6, 1).expand(2, 6, 3).clone()
    batch = {"target_features": features}
    mask = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    states, staleness = stale_target_states(batch, mask, 3, seed=0)
    rows, positions = mask.nonzero(as_tuple=True)
    assert (staleness >= 0).all() and (staleness <= torch.minimum(positions, torch.tensor(3))).all()
    assert (staleness[positions >= 1] >= 1).all()
    assert torch.equal(states[:, 0], features[rows, positions - staleness, 0])
    again = stale_target_states(batch, mask, 3, seed=0)[1]
    assert torch.equal(again, staleness)  # a fixed draw for evaluation


@pytest.fixture(scope="module")
def target_state_data(tiny_model, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("target-states") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, out, "--target_states", "true")) == 0
    return out


def test_gen_stores_the_targets_last_layer_states_on_the_mixed_tokens(target_state_data, tiny_model):
    from transformers import AutoModelForCausalLM

    rows = load_labelled(target_state_data)
    manifest = json.loads((target_state_data / "manifest.json").read_text())
    assert manifest["identity"]["target_states"] is True
    assert "`target_features`" in (target_state_data / "README.md").read_text()  # the card names the column
    row = rows.with_format("numpy")[0]
    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = torch.tensor([list(row["prompt_ids"]) + list(row["mixed_ids"])])
    with torch.no_grad():
        expected = target.model(input_ids=ids).last_hidden_state[0, len(row["prompt_ids"]) - 1:]
    stored = torch.as_tensor(row["target_features"], dtype=torch.float32)
    assert stored.shape == expected.shape == (len(row["mixed_ids"]) + 1, target.config.hidden_size)
    assert torch.allclose(stored, expected, atol=2e-2)
    assert not torch.allclose(stored, torch.as_tensor(row["features"], dtype=torch.float32), atol=2e-2)


def fit(data: Path, root: Path, *extra: str) -> int:
    return main(["train", "fit", "--config", str(CONFIGS / "specdecpp-ontime.yaml"), "--data.path", str(data),
                 "--data.val_fraction", "0.3", "--data.calibration_fraction", "0.3", "--data.batch_size", "2",
                 "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
                 "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1", *extra])


def test_a_head_reading_the_target_state_trains_with_position_weights_and_alpha_and_is_evaluated_offline(
        target_state_data, tmp_path):
    root = tmp_path / "head"
    assert fit(target_state_data, root, "--model.target_state", "true", "--model.position_gamma", "3",
               "--model.alpha_weight", "0.5", "--data.train_rows", "4") == 0
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    hparams = checkpoint["hyper_parameters"]
    assert hparams["head_args"]["target_state_size"] == hparams["hidden_size"] == 32
    assert {"head.target_mean", "head.target_std"} <= set(checkpoint["state_dict"])
    assert not any(key.startswith("alpha_out") for key in checkpoint["state_dict"])  # a training aid only
    # the subset trains on 4 rows, but every prompt of the training split stays out of the held-out set
    split = json.loads(next(root.rglob("split.json")).read_text())
    assert split["train"]["rows"] == 4
    data = AcceptanceDataModule(str(target_state_data), val_fraction=0.3, calibration_fraction=0.3)
    data.setup()
    assert sorted(hparams["data_split"]["train_prompts"]) == data.prompt_digests("train")
    assert len(hparams["data_split"]["train_prompts"]) > len(split["train"]["prompt_digests"])
    out = tmp_path / "eval"
    assert main(["eval", "--head", str(root / "checkpoints" / "last.ckpt"), "--data", str(target_state_data),
                 "--out", str(out), "--num-decode-prompts", "0", "--max-draft", "3"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["head"]["config"]["target_state_size"] == 32 and metrics["offline"]["head"]["auc"] > 0
    refused = tmp_path / "decode"  # decoding cannot feed it the target's state: refused before any work, not mid-sweep
    assert main(["eval", "--head", str(root / "checkpoints" / "last.ckpt"), "--data", str(target_state_data),
                 "--out", str(refused), "--num-decode-prompts", "2", "--max-draft", "3"]) == 2
    assert not refused.exists()


def test_training_subsets_are_nested_and_a_subset_larger_than_the_split_is_refused(target_state_data):
    def train_rows(count: int | None) -> set[tuple[str, int]]:
        data = AcceptanceDataModule(str(target_state_data), val_fraction=0.3, train_rows=count)
        data.setup()
        rows = data.splits["train"]
        return set(zip(rows["prompt_id"], rows["sample_index"]))

    whole, three, five = train_rows(None), train_rows(3), train_rows(5)
    assert len(three) == 3 and len(five) == 5 and three < five < whole
    with pytest.raises(UsageError, match="data.train_rows is 999"):
        train_rows(999)


def test_a_target_state_head_on_data_without_target_states_is_refused_in_one_line(trained, tmp_path):
    data, _ = trained
    assert fit(data, tmp_path / "head", "--model.target_state", "true") == 2


def test_a_head_reading_the_target_state_round_trips_and_refuses_a_call_without_it(tmp_path):
    from specheads.heads import OnTimeAcceptanceHead

    head = OnTimeAcceptanceHead(8, depth=1, extra_features=["q"], target_state_size=5).eval()
    head.set_target_statistics(torch.full((5,), 2.0), torch.full((5,), 3.0))
    head.save_pretrained(tmp_path)
    loaded = OnTimeAcceptanceHead.from_pretrained(tmp_path).eval()
    assert loaded.config["target_state_size"] == 5 and torch.equal(loaded.target_mean, torch.full((5,), 2.0))
    hidden, signals, target = torch.randn(4, 8), torch.rand(4, 1), torch.randn(4, 5)
    staleness = torch.tensor([1, 2, 6, 9])  # beyond TARGET_STALENESS counts as the last class
    assert torch.equal(head(hidden, signals, target_state=target, staleness=staleness),
                       loaded(hidden, signals, target_state=target, staleness=staleness))
    assert not torch.equal(head(hidden, signals, target_state=target, staleness=staleness),
                           head(hidden, signals, target_state=target, staleness=torch.ones(4, dtype=torch.long)))
    with pytest.raises(UsageError, match="pass target_state and staleness"):
        head(hidden, signals)
    assert "target_state_size" not in OnTimeAcceptanceHead(8).config  # unchanged configs without it
