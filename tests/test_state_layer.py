"""`state_layer`: a head can read an inner draft layer's state; gen stores it, train, eval and decoding follow it."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_args
from test_train import fit_args

from specheads.artifacts.checkpoint import load_trained
from specheads.cli import main
from specheads.dataset.datamodule import AcceptanceDataModule
from specheads.dataset.store import load_labelled, read_manifest
from specheads.decoding import BatchCache
from specheads.eval.run import check_data
from specheads.model_outputs.states import check_state_layer, decoder_forward
from specheads.pair.models import ModelSpec, load_model
from specheads.plumbing.errors import UsageError
from specheads.train.draft import load_draft

LAYER = 2  # the tiny draft (target minus layer 2) has 3 decoder layers


def test_state_layer_is_the_residual_stream_after_that_many_layers(tiny_model):
    model = load_model(ModelSpec(path=str(tiny_model)))
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        reference = model.model(input_ids=ids, output_hidden_states=True)
        for layer in (1, 2, 3):
            _, states = decoder_forward(model, layer, input_ids=ids)
            assert torch.allclose(states, reference.hidden_states[layer], atol=1e-6)
        output, states = decoder_forward(model, None, input_ids=ids)
    assert torch.equal(states, reference.last_hidden_state) and torch.equal(output.last_hidden_state, states)
    assert check_state_layer(model, 4) == 4 and check_state_layer(model, None) is None
    for bad in (0, 5, True):
        with pytest.raises(UsageError, match=r"give 1\.\.4"):
            check_state_layer(model, bad)


@pytest.fixture(scope="module")
def inner(tiny_model, prompts_file, tmp_path_factory):
    """The tiny pair's data with the state after draft layer 2 stored, and a head trained on it."""
    root = tmp_path_factory.mktemp("state-layer")
    data = root / "gen"
    assert main(tiny_args(tiny_model, prompts_file, data, "--state_layer", str(LAYER), "--num-prompts", "8")) == 0
    assert main(fit_args("specdecpp.yaml", data, root / "run", "--trainer.max_epochs", "1")) == 0
    return data, root


def test_gen_stores_the_inner_state_and_records_it(inner, tiny_model, prompts_file, tmp_path, capsys):
    data, _ = inner
    manifest = read_manifest(data)
    assert manifest["identity"]["state_layer"] == LAYER
    card = (data / "README.md").read_text()
    fields_row = next(line for line in card.splitlines() if line.startswith("| `features` |"))
    assert f"after draft layer {LAYER}" in fields_row and "last-layer" not in card and "last layer" not in card
    draft = load_draft(manifest)
    row = load_labelled(data).with_format("numpy")[0]
    with torch.no_grad():
        hidden = draft.model(torch.tensor([list(row["prompt_ids"]) + list(row["mixed_ids"])]),
                             output_hidden_states=True).hidden_states
    start = len(row["prompt_ids"]) - 1
    features = np.asarray(row["features"])
    assert np.allclose(features, hidden[LAYER][0, start:].numpy(), atol=2e-2, rtol=1e-2)
    assert not np.allclose(features, hidden[-1][0, start:].numpy(), atol=2e-2, rtol=1e-2)
    # the same run without the option is other data (another fingerprint); a layer the draft lacks is refused
    out = tmp_path / "last"
    assert main(tiny_args(tiny_model, prompts_file, out, "--num-prompts", "8")) == 0
    assert read_manifest(out)["fingerprint"] != manifest["fingerprint"] and "state_layer" not in read_manifest(out)["identity"]
    capsys.readouterr()
    assert main(tiny_args(tiny_model, prompts_file, tmp_path / "bad", "--state_layer", "7")) == 2
    assert "state_layer 7 is out of range for a draft with 3 decoder layers" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_training_online_and_eval_follow_the_state_layer(inner, tmp_path, capsys):
    data, root = inner
    trained = load_trained(str(root / "run" / "checkpoints" / "last.ckpt"))
    assert trained.head.state_layer == LAYER and trained.head.config["state_layer"] == LAYER
    # online training computes the stored inner states
    online = AcceptanceDataModule(str(data), mode="online", val_fraction=0.3, batch_size=4)
    stored = AcceptanceDataModule(str(data), mode="offline", val_fraction=0.3, batch_size=4)
    online.setup("fit"), stored.setup("fit")
    from specheads.dataset.targets import draft_features

    draft = load_draft(online.manifest)
    online_batch, offline_batch = next(iter(online.val_dataloader())), next(iter(stored.val_dataloader()))
    features = draft_features(draft, online_batch, online_batch["valid"].shape[1], trained.head.state_layer)
    valid = torch.cat([torch.ones_like(online_batch["valid"][:, :1]), online_batch["valid"]], 1)
    assert torch.allclose(features[valid], offline_batch["features"][valid].float(), atol=2e-2, rtol=1e-2)
    # the decoding loop hands the head the same inner state, from the cached forward
    runner = BatchCache(draft, 1, trained.head.state_layer)
    tokens = [1, 5, 9, 12, 3, 7]
    runner.feed({0: tokens[:4]})
    _, states = runner.feed({0: tokens[4:]}, {0: 2})[0]
    with torch.no_grad():
        fresh = draft.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[LAYER][0, -2:]
    assert torch.allclose(states, fresh, atol=1e-4, rtol=1e-4)
    # the exported head says which state it reads, and loads with it
    exported = tmp_path / "export"
    assert main(["export", "--ckpt", str(root / "run" / "checkpoints" / "last.ckpt"), "--out", str(exported)]) == 0
    assert json.loads((exported / "config.json").read_text())["state_layer"] == LAYER
    assert f"after decoder layer {LAYER}" in (exported / "README.md").read_text()
    from specheads.heads import load_head

    assert load_head(str(exported))[0].state_layer == LAYER
    # a head configured for another layer, and data holding another state, are refused
    assert main(fit_args("specdecpp.yaml", data, tmp_path / "r", "--model.head_args", "{depth: 1, state_layer: 1}")) == 2
    assert "model.head_args.state_layer is 1" in capsys.readouterr().err
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["identity"]["state_layer"]
    with pytest.raises(UsageError, match=r"stores the draft state of the last layer .* reads the state after draft layer 2"):
        check_data(trained, manifest, "last-layer-data", allow_other_data=True)
