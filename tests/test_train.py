"""`specheads train` on datasets labelled with the tiny pair: fit, metrics, resume, refusals, online mode, DDP."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, tiny_args

from specheads.artifacts.metrics import binary_kl, soft_auc
from specheads.cli import main
from specheads.dataset.datamodule import AcceptanceDataModule, RankBatchSampler, RowDataset, collate_rows, is_validation_prompt
from specheads.dataset.targets import token_targets
from specheads.heads import SIGNALS
from specheads.train.loss import weighted_bce
from specheads.train.module import AcceptanceModule

CONFIGS = Path(__file__).parents[1] / "configs" / "train"


@pytest.fixture(scope="module")
def labelled(tiny_model, prompts_file, tmp_path_factory) -> Path:
    """12 prompts × 2 samples on the tiny pair, features stored; every other row all target tokens."""
    out = tmp_path_factory.mktemp("train-data") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, out, "--mixing.schedule", "[0.15, 1.0]")) == 0
    return out


@pytest.fixture(scope="module")
def labelled_online(tiny_model, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train-data-online") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, out, "--store-features", "false", "--num-prompts", "6")) == 0
    return out


def fit_args(config: str, data: Path, root: Path, *extra: str) -> list[str]:
    return ["train", "fit", "--config", str(CONFIGS / config), "--data.path", str(data),
            "--data.val_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", *extra]


def last_metrics(root: Path) -> dict[str, float]:
    import csv

    rows = list(csv.DictReader(open(root / "metrics.csv")))
    merged = {}
    for row in rows:
        merged.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return merged


def test_weighted_bce_matches_the_formula():
    logits = torch.tensor([2.0, -1.0, 0.5])
    labels = torch.tensor([0.9, 0.2, 1.0])
    p = torch.sigmoid(logits)
    expected = -(1 * labels * p.log() + 6 * (1 - labels) * (1 - p).log()).sum() / (labels + 6 * (1 - labels)).sum()
    assert torch.allclose(weighted_bce(logits, labels, 1.0, 6.0), expected)
    assert torch.isfinite(weighted_bce(torch.tensor([80.0, -80.0]), torch.tensor([0.0, 1.0])))


def test_targets_pick_the_right_positions():
    batch = {"valid": torch.tensor([[True, True, True, False]]), "is_draft": torch.tensor([[False, True, False, False]]),
             "accept": torch.tensor([[0.5, 0.25, 1.0, 0.0]]), "logp": torch.tensor([[-1.0, -2.0, -0.5, 0.0]]),
             "logq": torch.tensor([[-1.0, -1.0, -0.6, 0.0]])}
    mask, label = token_targets(batch, "stop")
    assert mask.tolist() == [[False, True, False, False]] and label[mask].tolist() == [0.25]
    mask, label = token_targets(batch, "verify", tau=1.0)
    assert mask.tolist() == [[True, True, False, False]]  # after the draft token at 1, the prefix is mixed
    assert label[0, :3].tolist() == [1.0, 0.0, 1.0]
    mask, label = token_targets(batch, "verify", tau=math.e, contexts="all")
    assert mask.tolist() == [[True, True, True, False]] and label[0, 1] == 1.0


def test_split_is_by_prompt_and_ranks_cover_every_row_once():
    assert is_validation_prompt("p3", 0, 0.5) == is_validation_prompt("p3", 0, 0.5)
    share = np.mean([is_validation_prompt(f"p{i}", 1, 0.2) for i in range(4000)])
    assert abs(share - 0.2) < 0.03
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 50, 37)]
    val = [sorted(i for b in RankBatchSampler(lengths, 4, False, 0, rank, 2) for i in b) for rank in (0, 1)]
    assert sorted(val[0] + val[1]) == list(range(37))
    train = [list(RankBatchSampler(lengths, 4, True, 0, rank, 2)) for rank in (0, 1)]
    assert len(train[0]) == len(train[1]) == 37 // 8
    assert not set(i for b in train[0] for i in b) & set(i for b in train[1] for i in b)


def test_fit_writes_the_run_folder_and_resumes(labelled, tmp_path, capsys):
    root = tmp_path / "run"
    assert main(fit_args("specdecpp.yaml", labelled, root, "--trainer.max_epochs", "2")) == 0
    assert (root / "checkpoints" / "last.ckpt").is_file() and list((root / "checkpoints").glob("best-*.ckpt"))
    assert (root / "config.yaml").is_file() and (root / "tensorboard").is_dir()
    split = json.loads((root / "split.json").read_text())
    assert split["val"]["prompt_ids"] and not set(split["val"]["prompt_ids"]) & set(split["train"]["prompt_ids"])
    metrics = last_metrics(root)
    for name in ("val/binary_kl", "val/auc", "val/ece", "val/loss", "val/binary_kl_constant", "val/auc_svip_entropy",
                 "val/auc_draft_top1", "val/auc_draft_prob", "train/loss"):
        assert name in metrics, name
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["epoch"] == 1 and set(checkpoint["state_dict"]) == {
        "head.signal_mean", "head.signal_std", "head.hidden_mean", "head.hidden_std", "head.logit_correction",
        *(f"head.blocks.{i}.{p}" for i in range(3) for p in ("weight", "bias")),
        "head.out.weight", "head.out.bias"}
    hparams = checkpoint["hyper_parameters"]
    assert hparams["hidden_size"] == 32 and hparams["draft"] == "target minus layers 2"
    assert float(checkpoint["state_dict"]["head.signal_std"][1]) != 1.0  # standardised from the training split
    assert not torch.allclose(checkpoint["state_dict"]["head.hidden_std"], torch.ones(32))
    assert float(checkpoint["state_dict"]["head.logit_correction"]) == pytest.approx(math.log(6.0))  # w_rej / w_acc
    steps = checkpoint["global_step"]
    history = logged_epochs(root)
    assert history == {0, 1}
    # resume: one more epoch from last.ckpt, appended to the metrics history of the first two
    assert main(fit_args("specdecpp.yaml", labelled, root, "--trainer.max_epochs", "3", "--ckpt_path", "last")) == 0
    resumed = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["epoch"] == 2 and resumed["global_step"] == steps * 3 // 2
    assert logged_epochs(root) == {0, 1, 2}
    # a fresh run in the same folder starts a new history
    assert main(fit_args("specdecpp.yaml", labelled, root, "--trainer.max_epochs", "1")) == 0
    assert logged_epochs(root) == {0}


def logged_epochs(root: Path) -> set[int]:
    import csv

    return {int(float(row["epoch"])) for row in csv.DictReader(open(root / "metrics.csv")) if row.get("epoch")}


def test_validation_metrics_equal_a_recomputation(labelled, tmp_path):
    root = tmp_path / "run"
    assert main(fit_args("specdecpp.yaml", labelled, root, "--trainer.max_epochs", "1")) == 0
    module = AcceptanceModule.load_from_checkpoint(root / "checkpoints" / "last.ckpt").eval()  # no state dropout
    data = AcceptanceDataModule(str(labelled), val_fraction=0.3, batch_size=4)
    data.setup("validate")
    labels, predictions, entropy = [], [], []
    for batch in data.val_dataloader():
        logits, label, mask = module.head_inputs(batch)
        labels.append(label)
        predictions.append(module.head.probabilities(logits))
        entropy.append(batch["entropy"][mask])
    labels, predictions = torch.cat(labels).numpy(), torch.cat(predictions).detach().numpy()
    metrics = last_metrics(root)
    assert metrics["val/tokens"] == len(labels)
    assert metrics["val/binary_kl"] == pytest.approx(binary_kl(labels, predictions), rel=1e-4)
    assert metrics["val/auc"] == pytest.approx(soft_auc(labels, predictions), rel=1e-4)
    assert metrics["val/auc_svip_entropy"] == pytest.approx(soft_auc(labels, -np.sqrt(torch.cat(entropy).numpy())), rel=1e-4)


def test_sprinter_verifier_trains_on_consistent_contexts(labelled, tmp_path):
    root = tmp_path / "run"
    assert main(fit_args("sprinter.yaml", labelled, root, "--trainer.max_epochs", "1", "--model.tau", "1.2",
                         "--model.candidate_embedding", "true")) == 0
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["state_dict"]["head.out.weight"].shape == (1, 32 + 32 + len(SIGNALS))  # state, embedding, signals
    assert "embeddings.weight" not in checkpoint["state_dict"]
    assert checkpoint["hyper_parameters"]["tau"] == 1.2
    assert 0 < last_metrics(root)["val/mean_label"] <= 1


def test_online_mode_computes_the_stored_features(labelled, labelled_online, tmp_path):
    root = tmp_path / "run"
    assert main(fit_args("specdecpp.yaml", labelled_online, root, "--trainer.max_epochs", "1", "--data.val_fraction",
                         "0.5")) == 0
    assert AcceptanceDataModule(str(labelled_online)).mode == "online"
    # the draft states computed in the step equal the stored fp16 features of the offline dataset
    module = AcceptanceModule(hidden_size=32)
    data = AcceptanceDataModule(str(labelled), mode="online", val_fraction=0.3, batch_size=4)
    stored = AcceptanceDataModule(str(labelled), mode="offline", val_fraction=0.3, batch_size=4)
    data.setup("fit"), stored.setup("fit")
    from specheads.train.draft import load_draft

    module.draft_model = [load_draft(data.manifest)]
    online_batch, offline_batch = next(iter(data.val_dataloader())), next(iter(stored.val_dataloader()))
    features = module.draft_features(online_batch, online_batch["valid"].shape[1])
    valid = torch.cat([torch.ones_like(online_batch["valid"][:, :1]), online_batch["valid"]], 1)
    assert torch.allclose(features[valid], offline_batch["features"][valid].float(), atol=2e-2, rtol=1e-2)


def test_a_batch_read_in_one_take_equals_the_stored_rows(labelled):
    """RowDataset reads a batch with one Arrow take: every row keeps its own columns and float16 states."""
    from torch.utils.data import DataLoader

    from specheads.dataset.store import load_labelled

    rows = load_labelled(labelled)
    dataset = RowDataset(rows, with_features=True)
    indices = [3, 0, len(rows) - 1, 5, 3]
    reference = rows.with_format("numpy")
    for index, item in zip(indices, dataset.__getitems__(indices)):
        expected = reference[index]
        assert item["features"].dtype == np.float16 and item["features"].shape == expected["features"].shape
        np.testing.assert_array_equal(item["features"].astype(np.float32), expected["features"])
        for name in ("accept", "logq", "draft_ids", "is_draft", "mixed_ids", "prompt_ids"):
            np.testing.assert_array_equal(item[name], expected[name])
    batch = next(iter(DataLoader(dataset, batch_sampler=[indices], collate_fn=collate_rows)))
    lengths = [len(reference[i]["accept"]) for i in indices]
    assert batch["valid"].sum(1).tolist() == lengths
    for row, index in enumerate(indices):
        np.testing.assert_array_equal(batch["features"][row, : lengths[row] + 1].float().numpy(), reference[index]["features"])
        assert not batch["features"][row, lengths[row] + 1:].any()


def test_refusals(labelled, tmp_path, capsys):
    def refused(*extra, fragments):
        assert main(fit_args("specdecpp.yaml", labelled, tmp_path / "r", "--trainer.max_epochs", "1", *extra)) == 2
        err = capsys.readouterr().err
        for fragment in fragments:
            assert fragment in err, err

    refused("--model.hidden_size", "64", fragments=["expects hidden size 64", "hidden size 32"])
    refused("--model.draft", "some-other-draft", fragments=["some-other-draft", "target minus layers 2"])
    refused("--model.head", "nope", fragments=["unknown head type 'nope'", "specdecpp_resnet"])
    refused("--model.lr", "1e12", fragments=["loss became", "step", "learning rate"])
    assert main(fit_args("specdecpp.yaml", tmp_path / "missing", tmp_path / "r")) == 2
    assert "no manifest.json" in capsys.readouterr().err
    refused("--data.batch_size", "100", fragments=["fewer than one batch of data.batch_size 100",
                                                   "lower --data.batch_size to at most"])
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_run_stopped_by_sigterm_exits_non_zero(labelled, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "specheads",
                                *fit_args("specdecpp.yaml", labelled, root, "--trainer.max_epochs", "100000")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (root / "checkpoints" / "last.ckpt").exists() and process.poll() is None:
        time.sleep(0.05)
    assert process.poll() is None, "training must still be running when the signal comes"
    os.kill(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "--ckpt_path last" in err


DRAFTER_RECIPES = ("eagle3", "dspark")
"""eagle3-*, dspark-*: `train drafter` recipes, validated in tests/test_eagle3.py and tests/test_dspark.py."""
LOOKUP_RECIPES = ("lookup",)
"""lookup-*: `train lookup fit` recipes of free drafts' token heads, validated in tests/test_token_head.py."""
HEAD_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.stem.startswith(DRAFTER_RECIPES + LOOKUP_RECIPES))


@pytest.mark.parametrize("config", HEAD_CONFIGS, ids=lambda p: p.stem)
def test_train_configs_are_valid(config, labelled, capsys):
    import yaml

    assert main(["train", "fit", "--config", str(config), "--data.path", str(labelled), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["head"] in ("specdecpp_resnet", "specdecpp_ontime", "expected_acceptance", "sprinter_linear",
                                        "dspark_confidence")
    AcceptanceModule(**{**yaml.safe_load(config.read_text())["model"], "hidden_size": 32})  # constructor accepts it


def test_two_process_ddp_on_cpu(labelled, tmp_path):
    root = tmp_path / "ddp"
    result = run_cli(fit_args("specdecpp.yaml", labelled, root, "--trainer.max_epochs", "1", "--trainer.devices", "2",
                              "--trainer.strategy", "ddp"), env={"SPECHEADS_DEBUG": "1"})  # Lightning's rank lines
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world_size=2" in result.stderr or "distributed_backend=gloo" in result.stderr
    single = tmp_path / "single"
    assert run_cli(fit_args("specdecpp.yaml", labelled, single, "--trainer.max_epochs", "1")).returncode == 0
    # each of 2 ranks takes half of every global batch of 2 × 4 rows; validation gathers every token
    train_rows = json.loads((root / "split.json").read_text())["train"]["rows"]
    two = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    one = torch.load(single / "checkpoints" / "last.ckpt", weights_only=False)
    assert (two["global_step"], one["global_step"]) == (train_rows // 8, train_rows // 4)
    assert last_metrics(root)["val/tokens"] == last_metrics(single)["val/tokens"]


def test_class_weight_correction_recovers_the_soft_label():
    from specheads.heads import ResNetAcceptanceHead

    head = ResNetAcceptanceHead(4, depth=0)
    head.set_class_weights(1.0, 6.0)
    for a in (0.2, 0.6, 0.9):
        z = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.LBFGS([z], max_iter=100)

        def closure(optimizer=optimizer, z=z, a=a):
            optimizer.zero_grad()
            loss = weighted_bce(z.expand(1000), torch.full((1000,), a), 1.0, 6.0)
            loss.backward()
            return loss

        optimizer.step(closure)
        assert torch.sigmoid(z).item() == pytest.approx(a / (a + 6 * (1 - a)), abs=1e-4)  # the weighted optimum
        assert head.probabilities(z.detach()).item() == pytest.approx(a, abs=1e-4)  # corrected back to a


@pytest.mark.parametrize("head", ["specdecpp_resnet", "sprinter_linear"])
def test_untrained_head_starts_at_the_weighted_signal_probe(labelled, head):
    from specheads.dataset.datamodule import AcceptanceDataModule
    from specheads.train.loss import weighted_bce

    data = AcceptanceDataModule(str(labelled), val_fraction=0.3, batch_size=4)
    data.setup()
    w_rej = 6.0 if head == "specdecpp_resnet" else 1.0
    module = AcceptanceModule(head=head, extra_features=list(SIGNALS), hidden_size=data.hidden_size,
                              w_rej=w_rej, contexts="all")
    module.fit_statistics(data)
    batches = list(data.ordered_batches("train", with_features=True))
    assert torch.equal(batches[0]["q"], batches[0]["logq"].exp())  # the derived signal, as decoding derives it
    parts = [module.batch_inputs(batch) for batch in batches]
    hidden, signals, labels = (torch.cat([p[i] for p in parts]) for i in (0, 1, 3))
    out = module.head.out
    assert not out.weight[0, : data.hidden_size].any()  # the state starts with no say: only the signals count
    logits = module.head(hidden, signals)
    assert torch.allclose(logits, module.head(torch.randn_like(hidden), signals))
    loss = weighted_bce(logits, labels, 1.0, w_rej)
    loss.backward()
    # the probe minimises the training loss over the signal weights and the bias (up to sklearn's mild L2)
    assert out.weight.grad[0, -len(SIGNALS):].abs().max() < 0.02 and out.bias.grad.abs().max() < 0.02
    intercept_only = torch.full_like(logits, math.log(float(labels.sum()) / (w_rej * float((1 - labels).sum()))))
    assert loss < weighted_bce(intercept_only, labels, 1.0, w_rej)  # the signals carry information the constant lacks
    plain = AcceptanceModule(head=head, extra_features=list(SIGNALS), hidden_size=data.hidden_size,
                             w_rej=w_rej, contexts="all", start_from_signals=False)
    plain.fit_statistics(data)
    assert plain.head.out.weight[0, : data.hidden_size].any()  # the default initialisation, untouched
