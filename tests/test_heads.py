"""Acceptance heads: shapes, parameter counts, signal standardisation, save/load, and refusals."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specheads.heads import HEADS, SIGNALS, LinearVerifier, ResNetAcceptanceHead, build_head, head_class, with_derived_signals
from specheads.plumbing.errors import UsageError

H = 16


def resnet(depth: int = 2, extra_features: list[str] | None = None, state_layer: int | None = None
           ) -> ResNetAcceptanceHead:
    """A tiny ResNet head whose blocks are randomised, so that depth matters to its output."""
    torch.manual_seed(0)
    head = ResNetAcceptanceHead(H, depth=depth, extra_features=extra_features, state_layer=state_layer)
    with torch.no_grad():
        for block in head.blocks:
            block.weight.normal_(0, 0.3)
            block.bias.normal_(0, 0.3)
    return head


def heads_with_inputs() -> list[tuple]:
    """(head, its extra kwargs for a [N, H] batch) for one head of each type, with signals and embeddings."""
    n = 5
    return [
        (resnet(extra_features=["top1", "logq"]), {"signals": torch.randn(n, 2)}),
        (LinearVerifier(H, extra_features=["entropy"], candidate_embedding_size=8),
         {"signals": torch.randn(n, 1), "candidate_embedding": torch.randn(n, 8)}),
    ]


@pytest.mark.parametrize("extra_features", [[], ["logq"], list(SIGNALS)])
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_resnet_parameter_count_formula(depth, extra_features):
    d = H + len(extra_features)
    head = ResNetAcceptanceHead(H, depth=depth, extra_features=extra_features)
    assert head.num_parameters() == sum(p.numel() for p in head.parameters()) == depth * (d * d + d) + d + 1
    assert len(head.blocks) == depth


def test_linear_verifier_parameter_count():
    assert LinearVerifier(H).num_parameters() == H + 1
    assert LinearVerifier(H, extra_features=["top1"], candidate_embedding_size=8).num_parameters() == H + 8 + 1 + 1


def test_resnet_blocks_have_independent_weights():
    head = ResNetAcceptanceHead(H, depth=3)
    pointers = {block.weight.data_ptr() for block in head.blocks} | {block.bias.data_ptr() for block in head.blocks}
    assert len(pointers) == 6
    with torch.no_grad():
        head.blocks[0].weight.fill_(1.0)
    assert head.blocks[0].weight.abs().sum() > 0
    assert all(block.weight.abs().sum() == 0 for block in head.blocks[1:])


def test_fresh_resnet_head_starts_as_its_linear_probe():
    head = ResNetAcceptanceHead(H, depth=3)
    hidden = torch.randn(4, H)
    assert torch.allclose(head(hidden), head.out(hidden).squeeze(-1))
    head(hidden).sum().backward()
    assert all(block.weight.grad.abs().sum() > 0 for block in head.blocks)  # zero init still trains every block


def test_depth_changes_the_function():
    hidden = torch.randn(4, H)
    shallow, deep = resnet(depth=1), resnet(depth=3)
    deep.out.load_state_dict(shallow.out.state_dict())
    deep.blocks[0].load_state_dict(shallow.blocks[0].state_dict())
    assert not torch.allclose(shallow(hidden), deep(hidden))


@pytest.mark.parametrize("leading", [(2, 7), (5,), ()])
def test_forward_keeps_leading_dims_and_predict_is_sigmoid(leading):
    for head, _ in heads_with_inputs():
        kwargs = {"signals": torch.randn(*leading, len(head.extra_features))}
        if head.candidate_embedding_size:
            kwargs["candidate_embedding"] = torch.randn(*leading, head.candidate_embedding_size)
        hidden = torch.randn(*leading, H)
        logits = head(hidden, **kwargs)
        probs = head.predict(hidden, **kwargs)
        assert logits.shape == probs.shape == leading
        assert ((probs > 0) & (probs < 1)).all()
        assert torch.allclose(probs, torch.sigmoid(logits))
        assert not probs.requires_grad and logits.requires_grad


def test_save_and_load_round_trip(tmp_path):
    head = resnet(depth=2, extra_features=["entropy", "logq"], state_layer=5)
    mean, std = torch.tensor([2.5, -3.0]), torch.tensor([0.7, 4.0])
    head.set_signal_statistics(mean, std)
    head.save_pretrained(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"hidden_size": H, "depth": 2, "extra_features": ["entropy", "logq"], "state_dropout": 0.0,
                      "state_layer": 5, "head_type": "specdecpp_resnet", "reads": "candidate_state",
                      "decides": "one_step_late", "purpose": "stop", "role": "chain_stop", "calibration": None,
                      "candidate_embedding_size": 0}
    tensors = load_file(tmp_path / "model.safetensors")
    assert torch.equal(tensors["signal_mean"], mean) and torch.equal(tensors["signal_std"], std)
    assert (tmp_path / "README.md").exists()

    loaded = ResNetAcceptanceHead.from_pretrained(tmp_path)
    assert torch.equal(loaded.signal_mean, mean) and torch.equal(loaded.signal_std, std)
    assert loaded.extra_features == ["entropy", "logq"] and loaded.depth == 2 and loaded.state_layer == 5
    hidden, signals = torch.randn(3, 4, H), torch.randn(3, 4, 2)
    assert torch.equal(loaded.predict(hidden, signals), head.predict(hidden, signals))


def test_linear_verifier_round_trip_and_wrong_class_refused(tmp_path):
    head = LinearVerifier(H, candidate_embedding_size=8)
    head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["candidate_embedding_size"] == 8
    loaded = head_class("sprinter_linear").from_pretrained(tmp_path)
    hidden, embedding = torch.randn(5, H), torch.randn(5, 8)
    assert torch.equal(loaded.predict(hidden, candidate_embedding=embedding),
                       head.predict(hidden, candidate_embedding=embedding))
    with pytest.raises(UsageError, match="holds a 'sprinter_linear' head"):
        ResNetAcceptanceHead.from_pretrained(tmp_path)


def test_config_is_normalised_and_survives_deepcopy():
    head = ResNetAcceptanceHead(np.int64(H), depth=1, extra_features=("top1",))  # numpy int, tuple
    assert head.config["hidden_size"] == H and type(head.config["hidden_size"]) is int
    assert head.config["extra_features"] == ["top1"]
    assert ResNetAcceptanceHead(H).config["extra_features"] == []
    assert copy.deepcopy(head).config == head.config


def test_signals_are_standardised():
    head = resnet(extra_features=list(SIGNALS))
    k = len(SIGNALS)
    hidden, signals = torch.randn(4, H), torch.randn(4, k)
    before = head(hidden, signals)
    shift, scale = torch.eye(k)[0], torch.ones(k) + torch.eye(k)[0]
    head.set_signal_statistics(shift, torch.ones(k))
    assert not torch.allclose(before, head(hidden, signals))
    assert torch.allclose(before, head(hidden, signals + shift))
    head.set_signal_statistics(torch.zeros(k), scale)
    assert torch.allclose(before, head(hidden, signals * scale))


@pytest.mark.parametrize("head_type", sorted(HEADS))
def test_state_dropout_drops_state_dimensions_only_while_training(head_type, tmp_path):
    # an expected-acceptance head reads no ŷ; a dspark_confidence head reads no signals, as engines feed it none
    signal_names = {"expected_acceptance": ["entropy", "top1"], "dspark_confidence": []}.get(head_type, ["logq", "q"])
    head = build_head(head_type, hidden_size=H, extra_features=signal_names, state_dropout=0.5)
    head.set_hidden_statistics(torch.full((H,), 3.0), torch.full((H,), 2.0))
    hidden, signals = torch.randn(2000, H), torch.randn(2000, len(signal_names))
    standardised = (hidden - 3.0) / 2.0
    head.train()
    torch.manual_seed(0)
    features = head.features(hidden, signals)
    kept = features[:, :H] != 0
    assert 0.45 < kept.float().mean() < 0.55  # half the state dimensions fall to their training mean
    assert torch.allclose(features[:, :H][kept], 2 * standardised[kept])  # inverted dropout: the rest scaled by 1/(1-p)
    assert torch.equal(features[:, H:], signals)  # the signals are never dropped
    head.eval()
    assert torch.equal(head.features(hidden, signals)[:, :H], standardised)
    head.save_pretrained(tmp_path)
    loaded = head_class(head_type).from_pretrained(tmp_path)
    assert loaded.state_dropout == 0.5 and not loaded.training
    assert torch.equal(loaded.predict(hidden, signals), head.predict(hidden, signals))
    with pytest.raises(UsageError, match=r"state_dropout must be in \[0, 1\), got 1.0"):
        build_head(head_type, hidden_size=H, state_dropout=1.0)


def test_derived_signal_q_is_the_candidate_probability():
    logq = torch.tensor([-0.1, -2.0, 0.0])
    assert torch.allclose(with_derived_signals({"logq": logq})["q"], logq.exp())
    assert with_derived_signals({"logq": -2.0, "top1": 0.5}) == {"logq": -2.0, "top1": 0.5, "q": math.exp(-2.0)}


def test_signal_std_is_floored():
    head = LinearVerifier(H, extra_features=["top1"])
    head.set_signal_statistics(torch.zeros(1), torch.zeros(1))
    assert head.signal_std.item() > 0
    assert torch.isfinite(head(torch.randn(2, H), torch.randn(2, 1))).all()


@pytest.mark.parametrize("which", [0, 1])
def test_fp16_inputs_are_cast_to_the_head_dtype(which):
    head, kwargs = heads_with_inputs()[which]
    hidden = torch.randn(5, H)
    half = {name: value.half() for name, value in kwargs.items()}
    logits = head(hidden.half(), **half)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, head(hidden.half().float(), **{k: v.float() for k, v in half.items()}))
    assert head.predict(hidden.half(), **half).dtype == torch.float32


def test_fp16_hidden_alone_is_cast():
    head = ResNetAcceptanceHead(H, depth=1)
    hidden = torch.randn(2, 3, H).half()
    assert torch.equal(head(hidden), head(hidden.float()))


def test_registry_builds_every_head_type():
    assert set(HEADS) == {"specdecpp_resnet", "specdecpp_ontime", "expected_acceptance", "sprinter_linear",
                          "dspark_confidence"}
    for name, cls in HEADS.items():
        head = build_head(name, hidden_size=H)
        assert type(head) is cls and head.head_type == name and head.reads in ("candidate_state", "context_state")


def test_refusals_name_the_problem():
    known = "specdecpp_resnet, specdecpp_ontime, expected_acceptance, sprinter_linear, dspark_confidence"
    with pytest.raises(UsageError, match=f"unknown head type 'mlp'; known: {known}"):
        build_head("mlp", hidden_size=H)
    with pytest.raises(UsageError, match="unexpected keyword argument 'depth'"):
        build_head("sprinter_linear", hidden_size=H, depth=2)
    with pytest.raises(UsageError, match="unknown extra feature.*'margin'.*known: logq, entropy, top1"):
        ResNetAcceptanceHead(H, extra_features=["logq", "margin"])
    with pytest.raises(UsageError, match="twice"):
        LinearVerifier(H, extra_features=["logq", "logq"])
    with pytest.raises(UsageError, match="depth must be an integer >= 0, got -1"):
        ResNetAcceptanceHead(H, depth=-1)
    with pytest.raises(UsageError, match="hidden_size"):
        LinearVerifier(0)
    with pytest.raises(UsageError, match="signal std must have shape"):
        LinearVerifier(H, extra_features=["logq"]).set_signal_statistics(torch.zeros(1), torch.ones(2))


def test_bad_inputs_are_refused():
    head = ResNetAcceptanceHead(H, depth=1, extra_features=["logq"])
    with pytest.raises(UsageError, match=r"hidden must have shape \[3, 16\].*got \[3, 12\]"):
        head(torch.randn(3, 12), torch.randn(3, 1))
    with pytest.raises(UsageError, match="pass signals"):
        head(torch.randn(3, H))
    with pytest.raises(UsageError, match=r"signals must have shape \[3, 1\].*got \[3, 3\]"):
        head(torch.randn(3, H), torch.randn(3, 3))
    with pytest.raises(UsageError, match="reads no draft signals"):
        ResNetAcceptanceHead(H)(torch.randn(3, H), torch.randn(3, 1))
    with pytest.raises(UsageError, match="reads no candidate embedding"):
        head(torch.randn(3, H), torch.randn(3, 1), candidate_embedding=torch.randn(3, 4))
    verifier = LinearVerifier(H, candidate_embedding_size=8)
    with pytest.raises(UsageError, match="pass candidate_embedding"):
        verifier(torch.randn(3, H))
    with pytest.raises(UsageError, match=r"candidate_embedding must have shape \[3, 8\]"):
        verifier(torch.randn(3, H), candidate_embedding=torch.randn(3, 4))


def test_hidden_state_standardisation_is_applied_and_saved(tmp_path):
    torch.manual_seed(0)
    head = ResNetAcceptanceHead(H, depth=1)
    hidden = torch.randn(5, H) * 40 + 3
    before = head.predict(hidden)
    mean, std = hidden.mean(0), hidden.std(0)
    head.set_hidden_statistics(mean, std)
    assert not torch.allclose(head.predict(hidden), before)
    assert torch.allclose(head.features(hidden), (hidden - mean) / std, atol=1e-5)
    head.save_pretrained(tmp_path / "h")
    loaded = ResNetAcceptanceHead.from_pretrained(tmp_path / "h")
    assert torch.allclose(loaded.predict(hidden), head.predict(hidden))
    with pytest.raises(UsageError, match=rf"hidden std must have shape \[{H}\]"):
        head.set_hidden_statistics(mean, torch.ones(H + 1))
