"""Storage at scale: states kept only where the heads read them, bfloat16 states, and the bytes a token costs.

Each option must round-trip through training: the head inputs read from the smaller dataset are the very tensors
read from the full one, and the head trained on it is the same head.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_args

from specheads.cli import main
from specheads.dataset.datamodule import AcceptanceDataModule
from specheads.dataset.storage import kept_rows, serves
from specheads.dataset.store import load_labelled, read_manifest
from specheads.dataset.targets import CANDIDATE_STATE, CONTEXT_STATE, STOP, VERIFY, head_inputs, head_states, token_targets
from specheads.plumbing.errors import UsageError

CONFIGS = Path(__file__).parents[1] / "configs" / "train"
LABEL_COLUMNS = ("prompt_id", "sample_index", "target_ratio", "prompt_ids", "target_ids", "draft_ids", "mixed_ids",
                 "is_draft", "logp", "logq", "accept", "beta", "entropy", "top1", "top2")
CALIBRATION = ("--data.val_fraction", "0.1", "--data.calibration_fraction", "0.45")  # 3 + 4 of the 12 prompts
HEADS = {"specdecpp_resnet": ("specdecpp.yaml", CANDIDATE_STATE), "specdecpp_ontime": ("specdecpp-ontime.yaml", CONTEXT_STATE)}


def generate(tiny_model, prompts_file, out: Path, *extra: str) -> Path:
    """12 prompts × 2 samples on the tiny pair; every other row all target tokens (no drafted position at all)."""
    assert main(tiny_args(tiny_model, prompts_file, out, "--mixing.schedule", "[0.15, 1.0]", *extra)) == 0
    return out


@pytest.fixture(scope="module")
def datasets_by_option(tiny_model, prompts_file, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("storage")
    options = {"all": (), "drafted": ("--features_at", "drafted"),
               "drafted_candidate": ("--features_at", "drafted_candidate"),
               "bfloat16": ("--features_dtype", "bfloat16")}
    return {name: generate(tiny_model, prompts_file, root / name, *flags) for name, flags in options.items()}


@pytest.mark.parametrize("seed", range(20))
def test_kept_rows_are_exactly_the_rows_stop_heads_read(seed):
    """The rows each option keeps are those `head_inputs` reads for a stop head, and no other."""
    generator = np.random.default_rng(seed)
    n = int(generator.integers(1, 12))
    is_draft = generator.random(n) < 0.6
    batch = {"valid": torch.ones(1, n, dtype=torch.bool), "is_draft": torch.from_numpy(is_draft)[None],
             "accept": torch.rand(1, n)}
    mask, _ = token_targets(batch, STOP)
    rows = torch.arange(n + 1)[None]
    read = {reads: set(head_states(rows, reads)[mask].tolist()) for reads in (CANDIDATE_STATE, CONTEXT_STATE)}
    assert set(kept_rows(is_draft, "drafted_candidate").tolist()) == read[CANDIDATE_STATE]
    assert set(kept_rows(is_draft, "drafted_context").tolist()) == read[CONTEXT_STATE]
    assert set(kept_rows(is_draft, "drafted").tolist()) == read[CANDIDATE_STATE] | read[CONTEXT_STATE]
    assert kept_rows(is_draft, "all").tolist() == list(range(n + 1))
    assert not serves("drafted", CONTEXT_STATE, VERIFY) and serves("all", CONTEXT_STATE, VERIFY)
    assert not serves("drafted_candidate", CONTEXT_STATE, STOP) and not serves("drafted_context", CANDIDATE_STATE, STOP)


def test_drafted_data_holds_the_full_data_at_the_rows_it_keeps(datasets_by_option):
    full = load_labelled(datasets_by_option["all"]).with_format("numpy")
    for option in ("drafted", "drafted_candidate"):
        kept = load_labelled(datasets_by_option[option]).with_format("numpy")
        assert len(kept) == len(full)
        stored = 0
        for full_row, row in zip(full, kept):
            for name in LABEL_COLUMNS:
                np.testing.assert_array_equal(row[name], full_row[name], err_msg=name)
            rows = kept_rows(row["is_draft"], option)
            features = np.asarray(row["features"]).reshape(-1, 32)
            np.testing.assert_array_equal(features, np.asarray(full_row["features"])[rows])  # bit for bit
            stored += len(rows)
        manifest = read_manifest(datasets_by_option[option])
        assert manifest["identity"]["features_at"] == option
        assert manifest["storage"]["states_kept"] == stored
        assert stored < manifest["storage"]["states_of_all_positions"] == manifest["counts"]["labelled_tokens"] + len(full)


def test_bytes_per_token_are_measured_on_the_shards(datasets_by_option):
    storage = {}
    for option, folder in datasets_by_option.items():
        manifest = read_manifest(folder)
        storage[option] = manifest["storage"]
        shard_bytes = sum(path.stat().st_size for path in (folder / "shards").glob("*.arrow"))
        assert manifest["storage"]["shard_bytes"] == shard_bytes
        assert manifest["storage"]["bytes_per_labelled_token"] == pytest.approx(
            shard_bytes / manifest["counts"]["labelled_tokens"])
        kept = manifest["storage"]["states_kept"]
        state_bytes = manifest["storage"]["state_bytes_per_labelled_token"] * manifest["counts"]["labelled_tokens"]
        assert kept * 32 * 2 <= state_bytes <= kept * (32 * 2 + 4) + 8 * manifest["counts"]["rows"] + 64  # h × 2 + offsets
        card = (folder / "README.md").read_text()
        assert f"{manifest['storage']['bytes_per_labelled_token']:,.0f} bytes per labelled token" in card
        assert f"`features_at: {option if option.startswith('drafted') else 'all'}`" in card
    assert storage["bfloat16"]["state_bytes_per_labelled_token"] == storage["all"]["state_bytes_per_labelled_token"]
    assert storage["drafted_candidate"]["shard_bytes"] < storage["drafted"]["shard_bytes"] < storage["all"]["shard_bytes"]


def batches(folder: Path, **kwargs) -> list[dict]:
    data = AcceptanceDataModule(str(folder), val_fraction=0.3, batch_size=4, **kwargs)
    data.setup()
    return list(data.ordered_batches("train", with_features=True))


@pytest.mark.parametrize("head", list(HEADS))
def test_drafted_data_gives_the_same_head_inputs_and_trains_the_same_head(datasets_by_option, head, tmp_path):
    config, reads = HEADS[head]
    full, drafted = batches(datasets_by_option["all"]), batches(datasets_by_option["drafted"])
    assert "state_kept" in drafted[0] and "state_kept" not in full[0]
    read = 0
    for full_batch, batch in zip(full, drafted, strict=True):
        expected = head_inputs(full_batch, full_batch["features"], reads, STOP, ["logq"])
        found = head_inputs(batch, batch["features"], reads, STOP, ["logq"])
        for name, a, b in zip(("hidden", "signals", "embedding", "label", "mask"), expected, found):
            assert (a is None and b is None) or torch.equal(a, b), name
        read += len(found[0])
    assert read > 20
    heads = {}
    for option in ("all", "drafted"):
        root = tmp_path / option
        assert main(["train", "fit", "--config", str(CONFIGS / config), "--data.path", str(datasets_by_option[option]),
                     "--data.val_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir", str(root),
                     "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "2",
                     "--seed_everything", "0", *(CALIBRATION if "ontime" in config else ())]) == 0
        heads[option] = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert heads["all"].keys() == heads["drafted"].keys()
    for name, weight in heads["all"].items():
        assert torch.equal(weight, heads["drafted"][name]), name


def test_bfloat16_states_train_closely_the_same_head(datasets_by_option, tmp_path):
    assert load_labelled(datasets_by_option["bfloat16"]).features["features"].dtype == "uint16"  # bfloat16's bits
    full, bf16 = batches(datasets_by_option["all"]), batches(datasets_by_option["bfloat16"])
    for full_batch, batch in zip(full, bf16, strict=True):
        assert batch["features"].dtype == torch.bfloat16 and full_batch["features"].dtype == torch.float16
        expected = full_batch["features"].float()
        assert torch.allclose(batch["features"].float(), expected, rtol=2**-7, atol=1e-3)  # bf16 keeps 8 bits
        assert not torch.equal(batch["features"].float(), expected)  # really rounded otherwise
    heads = {}
    for option in ("all", "bfloat16"):
        root = tmp_path / option
        assert main(["train", "fit", "--config", str(CONFIGS / "specdecpp.yaml"), "--data.path",
                     str(datasets_by_option[option]), "--data.val_fraction", "0.3", "--data.batch_size", "4",
                     "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
                     "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "2", "--seed_everything", "0"]) == 0
        heads[option] = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, weight in heads["all"].items():  # within 2 % of each tensor's scale (the blocks move ~3e-3 in 2 epochs)
        assert (weight - heads["bfloat16"][name]).abs().max() <= 0.02 * weight.abs().max() + 1e-7, name


def test_a_head_reading_states_the_data_did_not_keep_is_refused(datasets_by_option, tmp_path, capsys):
    def fit(config: str, option: str, *extra: str) -> str:
        assert main(["train", "fit", "--config", str(CONFIGS / config), "--data.path", str(datasets_by_option[option]),
                     "--data.val_fraction", "0.3", "--data.batch_size", "4", "--trainer.default_root_dir",
                     str(tmp_path / "r"), "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", *extra]) == 2
        return capsys.readouterr().err

    err = fit("sprinter.yaml", "drafted")
    assert "features_at: drafted" in err and "sprinter_linear" in err and "--features_at all" in err
    err = fit("specdecpp-ontime.yaml", "drafted_candidate", *CALIBRATION)
    assert "features_at: drafted_candidate" in err and "context_state" in err
    assert not (tmp_path / "r" / "checkpoints").exists()
    # eval reads through head_inputs: a batch whose positions were not kept is refused there too
    batch = batches(datasets_by_option["drafted_candidate"])[0]
    with pytest.raises(UsageError, match="did not keep"):
        head_inputs(batch, batch["features"], CONTEXT_STATE, STOP, [])
    # online mode computes every state itself: the verifier trains
    assert main(["train", "fit", "--config", str(CONFIGS / "sprinter.yaml"), "--data.path",
                 str(datasets_by_option["drafted"]), "--data.mode", "online", "--data.val_fraction", "0.3",
                 "--data.batch_size", "4", "--trainer.default_root_dir", str(tmp_path / "online"),
                 "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                 "--trainer.max_epochs", "1"]) == 0


def test_the_storage_options_are_part_of_the_fingerprint(datasets_by_option, tiny_model, prompts_file, tmp_path, capsys):
    identities = {option: read_manifest(folder)["identity"] for option, folder in datasets_by_option.items()}
    assert "features_at" not in identities["all"] and "features_dtype" not in identities["all"]  # old data keeps its print
    assert identities["bfloat16"]["features_dtype"] == "bfloat16"
    prints = {read_manifest(folder)["fingerprint"] for folder in datasets_by_option.values()}
    assert len(prints) == len(datasets_by_option)
    folder = tmp_path / "copy"
    shutil.copytree(datasets_by_option["all"], folder)
    before = json.loads((folder / "manifest.json").read_text())
    assert main(tiny_args(tiny_model, prompts_file, folder, "--mixing.schedule", "[0.15, 1.0]",
                          "--features_at", "drafted")) == 2
    assert "differs in: features_at" in capsys.readouterr().err
    assert json.loads((folder / "manifest.json").read_text()) == before
    assert main(tiny_args(tiny_model, prompts_file, tmp_path / "none", "--store-features", "false",
                          "--features_dtype", "bfloat16")) == 2
    assert "store_features is false" in capsys.readouterr().err
