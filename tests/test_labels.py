"""Label correctness on the tiny pair against a brute-force recomputation, and the mixing statistics."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_args
from test_sampling import brute_force_probs
from torch.utils._python_dispatch import TorchDispatchMode

from specheads.cli import main
from specheads.data_gen.labels import label_positions
from specheads.dataset.store import load_labelled, read_manifest
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.signals import signal_log_probs, signal_statistics
from specheads.pair.models import ModelSpec, load_model

TRANSFORMS = {"plain": (1.0, 0, 1.0), "warped": (0.8, 20, 0.9), "greedy": (0.0, 0, 1.0)}


@pytest.fixture(scope="module", params=list(TRANSFORMS))
def labelled(request, tiny_model, prompts_file, tmp_path_factory):
    temperature, top_k, top_p = TRANSFORMS[request.param]
    out = tmp_path_factory.mktemp(f"labels-{request.param}")
    # 8 rows each: greedy responses are one per prompt, sampled ones two per prompt
    rows = ["--num-prompts", "8", "--samples-per-prompt", "1"] if temperature == 0 else ["--num-prompts", "4"]
    code = main(tiny_args(tiny_model, prompts_file, out, *rows, "--temperature", str(temperature),
                          "--top-k", str(top_k), "--top-p", str(top_p)))
    assert code == 0
    return out, (temperature, top_k, top_p)


def test_labels_match_brute_force(labelled, tiny_model):
    out, (temperature, top_k, top_p) = labelled
    rows = load_labelled(out)
    target = load_model(ModelSpec(path=str(tiny_model)))
    draft = load_model(ModelSpec(path=str(tiny_model), skip_layers=[2]))
    assert len(draft.model.layers) == 3
    for row in rows.select(range(3)):
        prompt, response, candidates = row["prompt_ids"], row["target_ids"], row["draft_ids"]
        sequence = torch.tensor([prompt + response])
        with torch.no_grad():
            p_logits = target(sequence).logits[0]
            q_logits = draft(sequence).logits[0]
        for i, candidate in enumerate(candidates):
            position = len(prompt) - 1 + i
            p = brute_force_probs(p_logits[position].tolist(), temperature, top_k, top_p)
            q = brute_force_probs(q_logits[position].tolist(), temperature, top_k, top_p)
            assert q[candidate] > 0, "the candidate must lie in q's support"
            assert row["logq"][i] == pytest.approx(math.log(q[candidate]), abs=1e-4)
            expected_logp = math.log(p[candidate]) if p[candidate] > 0 else -math.inf
            assert row["logp"][i] == pytest.approx(expected_logp, abs=1e-4)
            assert row["accept"][i] == pytest.approx(min(1.0, p[candidate] / q[candidate]), abs=1e-4)
            assert row["accept"][i] == pytest.approx(min(1.0, math.exp(row["logp"][i] - row["logq"][i])), abs=1e-5)
            assert row["beta"][i] == pytest.approx(sum(min(a, b) for a, b in zip(p, q)), abs=1e-4)
            signal = q if temperature else torch.softmax(q_logits[position], -1).tolist()
            assert row["entropy"][i] == pytest.approx(-sum(x * math.log(x) for x in signal if x > 0), abs=1e-4)
            assert row["top1"][i] == pytest.approx(max(signal), abs=1e-5)
            assert row["top2"][i] == pytest.approx(sorted(signal)[-2], abs=1e-5)  # the top-2 margin's other half
            if temperature == 0:
                assert candidate == int(q_logits[position].argmax())
                assert row["accept"][i] in (0.0, 1.0)


def test_responses_mixing_and_features_are_consistent(labelled, tiny_model):
    out, (temperature, _, _) = labelled
    rows = load_labelled(out).with_format("numpy")
    draft = load_model(ModelSpec(path=str(tiny_model), skip_layers=[2]))
    eos = draft.config.eos_token_id
    assert rows.features["features"].dtype == "float16"  # stored fp16 (the numpy view upcasts)
    for row in rows:
        target, candidates, mixed, is_draft = row["target_ids"], row["draft_ids"], row["mixed_ids"], row["is_draft"]
        assert 1 <= len(target) <= 12 and (eos not in target[:-1])
        assert np.array_equal(mixed, np.where(is_draft, candidates, target))
        features = np.asarray(row["features"])
        assert features.shape == (len(target) + 1, 32)
    row = rows[0]
    with torch.no_grad():
        states = draft.model(torch.tensor([list(row["prompt_ids"]) + list(row["mixed_ids"])])).last_hidden_state[0]
    start = len(row["prompt_ids"]) - 1
    assert np.allclose(np.asarray(row["features"]), states[start:].numpy(), atol=2e-2, rtol=1e-2)


def test_manifest_and_card_describe_the_run(labelled):
    out, (temperature, top_k, top_p) = labelled
    manifest = read_manifest(out)
    rows = load_labelled(out)
    assert manifest["complete"] and manifest["counts"]["rows"] == len(rows) == 8
    assert manifest["counts"]["labelled_tokens"] == sum(len(t) for t in rows["target_ids"])
    assert manifest["identity"]["sampling"] == {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                                "max_new_tokens": 12}
    mean = float(np.mean(np.concatenate([np.asarray(a) for a in rows["accept"]])))
    assert manifest["mean_accept"] == pytest.approx(mean, abs=1e-6)
    card = (out / "README.md").read_text()
    assert f"{mean:.4f}" in card and "min(1, p/q)" in card and manifest["fingerprint"] in card


def test_mixing_ratio_statistics(tiny_model, prompts_file, tmp_path):
    code = main(tiny_args(tiny_model, prompts_file, tmp_path / "mix", "--mixing.target_ratio", "0.3",
                          "--samples-per-prompt", "4", "--max-new-tokens", "24", "--store-features", "false"))
    assert code == 0
    flags = np.concatenate([np.asarray(f) for f in load_labelled(tmp_path / "mix")["is_draft"]])
    n = len(flags)
    assert n > 500
    assert abs(flags.mean() - 0.7) < 4 * math.sqrt(0.21 / n)


def test_mixing_schedule_gives_each_prefix_kind(tiny_model, prompts_file, tmp_path):
    code = main(tiny_args(tiny_model, prompts_file, tmp_path / "sched", "--mixing.schedule", "[0.0, 1.0, 0.15]",
                          "--samples-per-prompt", "3", "--store-features", "false"))
    assert code == 0
    rows = load_labelled(tmp_path / "sched")
    ratios = np.round(np.asarray(rows["target_ratio"]), 2)
    assert sorted(np.unique(ratios, return_counts=True)[1].tolist()) == [12, 12, 12]
    for ratio, flags in zip(ratios, rows["is_draft"]):
        if ratio == 0.0:
            assert all(flags)
        elif ratio == 1.0:
            assert not any(flags)


class VocabularyPasses(TorchDispatchMode):
    """The selections over a row of the vocabulary (top-k, max, sort) run while open, by op name."""

    SELECTIONS = {"topk", "amax", "max", "argmax", "sort", "kthvalue"}

    def __init__(self, width: int):
        super().__init__()
        self.width, self.ops = width, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SELECTIONS and args and args[0].shape[-1] == self.width:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_the_top_two_signals_come_from_one_pass_over_the_vocabulary_unchanged(tiny_model, transform):
    """top1 and top2 (the top-2 margin's halves) from one `topk(2)`, not an `amax` and then a `topk(2)`; the labels keep
    their values to the bit: top1 is q's maximum, top2 the exp of the second-largest log q."""
    draft = load_model(ModelSpec(path=str(tiny_model), skip_layers=[2]))
    with torch.no_grad():
        draft_logits, target_logits = (model(torch.tensor([[5, 9, 30, 41, 7, 12, 60, 3, 99, 14]])).logits[0]
                                       for model in (draft, load_model(ModelSpec(path=str(tiny_model)))))
    sampling = SamplingTransform(*TRANSFORMS[transform])
    uniforms = torch.rand(len(draft_logits), generator=torch.Generator().manual_seed(0))
    labels = label_positions(target_logits, draft_logits, sampling, uniforms)
    signal = signal_log_probs(draft_logits, sampling.log_probs(draft_logits), sampling)
    with VocabularyPasses(draft_logits.shape[-1]) as passes:  # what labelling and decoding read the signals with
        signal_statistics(signal)
    assert passes.ops == ["topk"]
    assert torch.equal(labels.top1, signal.exp().amax(-1))
    assert torch.equal(labels.top2, signal.topk(2, dim=-1).values[..., 1].exp())
