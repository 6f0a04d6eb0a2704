"""Labels of free drafts (`specheads gen --drafter.kind lookup|suffix`): every label equals a separate target forward's
value, the inputs are known before the verify, and gen writes, resumes and refuses like gen."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_args

from specheads.cli import main
from specheads.data_gen.lookup_labels import (
    ProposalInput,
    label_row,
    ngram_proposer,
    proposal_inputs,
    reached_length,
)
from specheads.dataset.lookup import load_lookup
from specheads.dataset.store import read_manifest
from specheads.lookup.features import FEATURE_NAMES, token_features
from specheads.lookup.proposers import suffix_available
from specheads.lookup.token_head import TokenHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, load_model
from specheads.train.lookup import flat_tokens

PROMPT = [5, 9, 14, 5, 9, 21, 30, 5, 9, 14, 40, 41, 42, 5, 9]


def scripted(response: list[int], prompt_length: int):
    """Proposals that copy the response's continuation at even positions (so some tokens are accepted) and a shifted
    guess at odd ones, with one wrong token after two right ones: both label values occur at every depth."""

    def propose(context: list[int]) -> SimpleNamespace:
        start = len(context) - prompt_length
        ahead = response[start: start + 4]
        tokens = tuple(ahead[:2] + [ahead[-1] + 1] + ahead[3:]) if start % 2 == 0 else tuple(t + 1 for t in ahead[:3])
        return SimpleNamespace(tokens=tokens, match_length=1 + start % 3, match_count=1, distance=start,
                               scores=tuple(0.5 for _ in tokens), source="prompt", copy_length=start % 7)

    return propose


def brute_force_label(target, context: list[int], token: int, transform: SamplingTransform) -> float:
    """p(token | context) under the transform, from a separate forward over the whole context."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([context])).logits[0, -1]
    return float(transform.log_probs(logits[None])[0, token].exp())


def brute_force_state(target, context: list[int]) -> torch.Tensor:
    """The target's last-layer state after the final norm at the context's last position, from a separate forward."""
    with torch.no_grad():
        return target.get_decoder()(input_ids=torch.tensor([context])).last_hidden_state[0, -1]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_every_label_equals_a_separate_target_forward(tiny_model, temperature):
    target = load_model(ModelSpec(path=str(tiny_model)))
    transform = SamplingTransform(temperature, 20 if temperature == 0.7 else 0, 1.0)
    with torch.no_grad():  # the target's own greedy response: the copied tokens are accepted at T = 0
        response = target.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)[0, len(PROMPT):].tolist()
    inputs = proposal_inputs(PROMPT, response, scripted(response, len(PROMPT)))
    labels, states = label_row(target, PROMPT, response, inputs, transform, torch.device("cpu"))
    checked = []
    for item, row in zip(inputs, labels):
        for k, token in enumerate(item.proposal.tokens):
            context = [*PROMPT, *response[: item.start], *item.proposal.tokens[:k]]
            expected = brute_force_label(target, context, token, transform)
            assert row[k] == pytest.approx(expected, abs=1e-5), (item.start, k)
            checked.append(expected)
    assert len(checked) > 20
    reached, _ = label_row(target, PROMPT, response, inputs, transform, torch.device("cpu"), reached_only=True)
    lengths = [len(kept) for kept in reached]
    assert lengths == [reached_length(item, response) for item in inputs] and sum(lengths) < len(checked)
    for kept, full in zip(reached, labels):  # the response's own forward gives what the packed read gives
        assert kept == pytest.approx(full[: len(kept)], abs=1e-5)
    if temperature == 0:
        assert set(checked) == {0.0, 1.0}
    for start in (0, 4, len(response) - 1):
        assert torch.allclose(states[start], brute_force_state(target, [*PROMPT, *response[:start]]), atol=1e-5)


def test_rounds_of_the_full_verify_decode_and_their_inputs():
    response = [1, 2, 3, 4, 5, 6, 7, 8]
    fixed = {0: (1, 2, 9), 3: (4, 5, 6), 7: (8,)}  # round 0 accepts 2 (ends at 3), round 3 accepts 3 (ends at 7)

    def propose(context: list[int]) -> SimpleNamespace:
        tokens = fixed.get(len(context), (99,))
        return SimpleNamespace(tokens=tokens, match_length=2, match_count=1, distance=3, scores=(1.0,) * len(tokens),
                               source="output", copy_length=len(context) % 5)

    inputs = proposal_inputs([], response, propose)
    assert [x.start for x in inputs if x.round_start] == [0, 3, 7]
    for item in inputs:  # each position's inputs are its own proposal's, whatever the rounds before it did
        assert np.array_equal(item.features, token_features(item.proposal)), item.start
        assert item.features[0, FEATURE_NAMES.index("log_copy_length")] == pytest.approx(np.log1p(item.start % 5))


def test_inputs_are_known_before_the_verify():
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 6, size=40)]
    response = [int(t) for t in rng.integers(0, 6, size=60)]
    propose = ngram_proposer(len(prompt), 5, 3, 1)
    inputs = {x.start: x for x in proposal_inputs(prompt, response, propose)}
    assert sum(x.round_start for x in inputs.values()) > 5
    for cut in (10, 25, 45):
        changed = response[:cut] + [int(t) for t in rng.integers(0, 6, size=len(response) - cut)]
        again = {x.start: x for x in proposal_inputs(prompt, changed, ngram_proposer(len(prompt), 5, 3, 1))}
        for start in (s for s in inputs if s <= cut):
            same: ProposalInput = again[start]
            assert same.proposal.tokens == inputs[start].proposal.tokens
            assert np.array_equal(same.features, inputs[start].features), (cut, start)
            assert same.round_start == inputs[start].round_start


def lookup_args(model, prompts, out, *extra: str) -> list[str]:
    args = tiny_args(model, prompts, out, "--drafter.kind", "lookup", "--samples-per-prompt", "1", "--num-prompts", "6",
                     "--rows-per-shard", "4", "--batch-size", "2", *extra)
    args.remove("--draft.skip_layers")
    args.remove("[2]")
    return args


def test_gen_writes_resumes_and_trains(tiny_model, prompts_file, tmp_path, capsys):
    out = tmp_path / "lookup"
    assert main(lookup_args(tiny_model, prompts_file, out, "--temperature", "0", "--target-states", "true")) == 0
    manifest = read_manifest(out)
    assert manifest["complete"] and manifest["identity"]["draft"]["kind"] == "lookup"
    rows = load_lookup(out)
    tokens = flat_tokens(rows, with_states=True)
    assert set(np.unique(tokens["label"])) <= {0.0, 1.0} and len(tokens["label"]) > 10
    assert tokens["features"].shape[1] == len(FEATURE_NAMES) and tokens["target_state"].shape[1] == 32
    assert_greedy_consistent(rows)
    # a killed run's shard is labelled again, the rest kept: the rows come back identical
    before = list(rows)
    (out / "shards" / "shard-00001.arrow").unlink()
    assert main(lookup_args(tiny_model, prompts_file, out, "--temperature", "0", "--target-states", "true")) == 0
    assert list(load_lookup(out)) == before
    root = tmp_path / "train"
    assert main(["train", "lookup", "fit", "--config", "lookup-stop-target", "--data.path", str(out),
                 "--data.val_fraction", "0.4", "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root),
                 "--trainer.enable_progress_bar", "false"]) == 0
    head = TokenHead.load(root / "head", draft_kind="lookup", target_state_size=32)
    assert head.config["training_data"]["fingerprint"] == manifest["fingerprint"]


def assert_greedy_consistent(rows) -> None:
    """At T = 0 a proposed token whose earlier tokens all continued the greedy response is accepted exactly when it
    continues it too."""
    reached = 0
    for row in rows:
        response, survived = row["target_ids"], True
        for start, position, token, label in zip(row["start"], row["position"], row["token"], row["label"]):
            survived = True if position == 1 else survived
            index = start + position - 1
            if survived and index < len(response):
                assert label == float(token == response[index]), (row["prompt_id"], start, position)
                reached += 1
            survived = survived and label == 1.0
    assert reached > 10


@pytest.mark.skipif(not suffix_available(), reason="arctic-inference is not installed (the `suffix` extra)")
def test_suffix_drafts_are_labelled(tiny_model, prompts_file, tmp_path):
    out = tmp_path / "suffix"
    assert main(lookup_args(tiny_model, prompts_file, out, "--temperature", "0", "--drafter.kind", "suffix")) == 0
    assert read_manifest(out)["identity"]["draft"] == {"kind": "suffix", "depth": 8}
    rows = load_lookup(out)
    assert_greedy_consistent(rows)
    tokens = flat_tokens(rows, with_states=False)
    assert (tokens["features"][:, FEATURE_NAMES.index("score")] > 0).all()
    further = tmp_path / "suffix-further"
    assert main(lookup_args(tiny_model, prompts_file, further, "--temperature", "0", "--drafter.kind", "suffix",
                            "--drafter.max_spec_factor", "4", "--drafter.min_token_prob", "0")) == 0
    assert read_manifest(further)["identity"]["draft"] == {"kind": "suffix", "depth": 8, "max_spec_factor": 4.0,
                                                           "min_token_prob": 0.0}
    assert len(flat_tokens(load_lookup(further), with_states=False)["label"]) > len(tokens["label"])


def test_refusals_of_a_free_draft(tiny_model, prompts_file, tmp_path, capsys):
    for extra, expected in ((("--drafter.path", "somewhere"), "--drafter.path cannot go with --drafter.kind lookup"),
                            (("--drafter.min_ngram", "4"), "min_ngram 4 is above --drafter.max_ngram 3"),
                            (("--drafter.max_spec_factor", "4"), "--drafter.max_spec_factor read a suffix tree")):
        assert main(lookup_args(tiny_model, prompts_file, tmp_path / "x", *extra)) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["train", "lookup", "fit", "--config", "lookup-stop", "--data.path", str(tmp_path),
                 "--trainer.default_root_dir", str(tmp_path / "t")]) == 2
    assert "holds no lookup labels" in capsys.readouterr().err
