"""The token-only head of free drafts: its features, its runtime (`specheads.lookup.token_head`), the training module
(`specheads.heads.lookup`, `specheads.train.lookup`) computing the very same floats, refusals, and a planted signal."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml

from specheads.artifacts.metrics import soft_auc
from specheads.heads.lookup import TokenHeadModel
from specheads.lookup.features import FEATURE_NAMES, token_features
from specheads.lookup.proposers import Proposal
from specheads.lookup.token_head import EXPECTED, STOP, TokenHead, conditional_estimates
from specheads.plumbing.errors import UsageError
from specheads.train.lookup import LookupDataModule, LookupHeadModule, proposal_products

CONFIGS = Path(__file__).parents[1] / "configs" / "train"


def trained_head(head_type: str = STOP, state: int = 0, seed: int = 0) -> TokenHeadModel:
    """A head whose every weight and statistic is random (a fresh head's zero blocks would hide a wrong block)."""
    torch.manual_seed(seed)
    model = TokenHeadModel(head_type, width=16, depth=2, target_state_size=state)
    with torch.no_grad():
        for tensor in model.tensors().values():
            tensor.copy_(torch.randn_like(tensor) * 0.3 + (1.0 if tensor.dim() == 1 and tensor.numel() > 1 else 0.0))
    return model


def test_features_follow_the_proposal_alone():
    proposal = Proposal((5, 6, 7), 2, 3, 10, (0.9, 0.5, 0.8), "output", copy_length=40)
    rows = token_features(proposal)
    named = [dict(zip(FEATURE_NAMES, row)) for row in rows]
    assert rows.shape == (3, len(FEATURE_NAMES)) and rows.dtype == np.float32
    assert [row["position"] for row in named] == [1, 2, 3]
    assert [row["min_score"] for row in named] == pytest.approx([0.9, 0.5, 0.5])
    assert [row["product_score"] for row in named] == pytest.approx([0.9, 0.45, 0.36])
    assert named[0]["from_output"] == 1 and named[0]["log_match_count"] == pytest.approx(np.log(4))
    assert [row["log_copy_length"] for row in named] == pytest.approx([np.log(41)] * 3)
    assert [row["proposal_length"] for row in named] == [3, 3, 3] and named[2]["match_length"] == 2


def test_runtime_equals_the_training_module_bit_for_bit(tmp_path):
    for head_type, state in ((STOP, 0), (EXPECTED, 0), (STOP, 8)):
        model = trained_head(head_type, state)
        folder = model.export(tmp_path / f"{head_type}-{state}")
        head = TokenHead.load(folder, draft_kind="lookup", target_state_size=state)
        features = token_features(Proposal((1, 2, 3, 4), 3, 2, 40, (1.0, 0.7, 0.7, 0.2), "prompt", 12))
        target = np.random.default_rng(0).normal(size=(4, state)).astype(np.float32) if state else None
        with torch.no_grad():
            module = torch.sigmoid(model(torch.as_tensor(features), None if target is None else torch.as_tensor(target)))
        assert np.array_equal(head.probabilities(features, target), module.numpy().astype(np.float64))
        assert np.array_equal(TokenHeadModel.from_runtime(head).out.weight.detach(), model.out.weight.detach())


def test_a_mutated_runtime_weight_changes_the_scores(tmp_path):
    # the equality above is not vacuous: the runtime reads every block
    model = trained_head()
    head = TokenHead.load(model.export(tmp_path / "head"))
    features = token_features(Proposal((1, 2), 2, 1, 5, (0.5, 0.5), "prompt", 2))
    before = head.probabilities(features)
    head.tensors["blocks.1.weight"] = head.tensors["blocks.1.weight"] + 0.1
    assert not np.array_equal(before, head.probabilities(features))


def test_expected_heads_survival_becomes_conditional_estimates():
    assert conditional_estimates(np.array([0.8, 0.4, 0.5]), EXPECTED) == pytest.approx([0.8, 0.5, 1.0])
    assert conditional_estimates(np.array([0.8, 0.4, 0.5]), STOP) == pytest.approx([0.8, 0.4, 0.5])
    assert conditional_estimates(np.array([0.0, 0.0]), EXPECTED) == pytest.approx([0.0, 0.0])


def refused(folder: Path, **kwargs) -> str:
    with pytest.raises(UsageError) as error:
        TokenHead.load(folder, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_refusals_of_another_head(tmp_path):
    folder = trained_head().export(tmp_path / "head")
    assert "not a token head folder" in refused(tmp_path / "nowhere")
    assert "trained on 'lookup' drafts, not 'suffix'" in refused(folder, draft_kind="suffix")
    assert "reads token ids only, not 32" in refused(folder, target_state_size=32)
    config = json.loads((folder / "config.json").read_text())
    for change, expected in (({"head_type": "specdecpp_ontime", "format": None}, "holds a 'specdecpp_ontime' head"),
                             ({"inputs": ["position"]}, "not this version's token features"),
                             ({"width": 17}, "does not hold the tensors")):
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        assert expected in refused(folder)
    (folder / "config.json").write_text("{not json")
    assert "not valid JSON" in refused(folder)


def test_proposal_products_restart_at_each_proposal():
    reach, survival = proposal_products(np.array([1.0, 0.5, 0.0, 1.0, 0.2]), np.array([1, 2, 3, 1, 2]))
    assert reach == pytest.approx([1.0, 1.0, 0.5, 1.0, 1.0])
    assert survival == pytest.approx([1.0, 0.5, 0.0, 1.0, 0.2])


class PlantedData(LookupDataModule):
    """Synthetic token features whose acceptance depends on the match length alone (P = 0.1 at 1, 0.9 at 3+)."""

    def __init__(self, seed: int) -> None:
        super().__init__("planted", val_fraction=0.5, batch_size=256)
        rng = np.random.default_rng(seed)
        self.splits = {name: self.tokens(rng, 3000) for name in ("train", "val")}

    @staticmethod
    def tokens(rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
        features = rng.normal(size=(count, len(FEATURE_NAMES))).astype(np.float32)
        match = rng.integers(1, 5, size=count)
        features[:, FEATURE_NAMES.index("match_length")] = match
        label = (rng.random(count) < np.where(match >= 3, 0.9, 0.1)).astype(np.float64)
        position = np.ones(count, dtype=np.int64)
        reach, survival = proposal_products(label, position)
        return {"features": features, "label": label, "reach": reach, "survival": survival}

    @property
    def manifest(self) -> dict:
        return {"identity": {"draft": {"kind": "lookup"}, "sampling": {}}, "fingerprint": "planted"}


def test_the_token_head_learns_a_planted_signal(tmp_path):
    recipe = yaml.safe_load((CONFIGS / "lookup-stop.yaml").read_text())["model"]
    module = LookupHeadModule(**{**recipe, "export": str(tmp_path / "head")})
    data = PlantedData(seed=1)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    head = TokenHead.load(tmp_path / "head")
    val = data.splits["val"]
    scores = head.probabilities(val["features"])
    assert soft_auc(val["label"], scores) > 0.85  # the match length separates 0.1 from 0.9: AUC 0.9 at best
    short = val["features"][:, FEATURE_NAMES.index("match_length")] < 3
    assert scores[short].mean() < 0.25 and scores[~short].mean() > 0.75
    assert trainer.callback_metrics["val/auc"] > 0.85


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("lookup-*.yaml")), ids=lambda p: p.stem)
def test_lookup_train_configs_are_valid(config, capsys):
    from specheads.cli import main

    assert main(["train", "lookup", "fit", "--config", str(config), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["head"] in (STOP, EXPECTED)
    assert printed["model"]["target_state"] == printed["data"]["target_state"]
    LookupHeadModule(**yaml.safe_load(config.read_text())["model"])  # the constructor accepts it
