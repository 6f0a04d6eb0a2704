"""The one-pass labeller (data_gen.onepass, issue 50): the rows `generate` + `label_batch` make, the target's response
distribution, gen's choice of path, and the fingerprint of the new mixing stream."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
import torch
from conftest import tiny_args
from scipy.stats import binomtest, chisquare
from transformers import LlamaConfig, LlamaForCausalLM

import specheads.data_gen.module as module
from specheads.cli import main
from specheads.data_gen.engines import BuiltinEngine
from specheads.data_gen.labels import LABELLER, label_batch
from specheads.data_gen.onepass import OnePass, ProbeFailed, derived_layout
from specheads.data_gen.plan import WorkItem
from specheads.data_gen.run import fingerprint_of
from specheads.dataset.store import MANIFEST, load_labelled, read_manifest
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, derived_layers, load_pair, stop_token_ids, without_layers

CPU = torch.device("cpu")
TRANSFORMS = {"plain": SamplingTransform(1.0, 0, 1.0), "warped": SamplingTransform(0.8, 20, 0.9),
              "greedy": SamplingTransform(0.0, 0, 1.0)}
MAX_NEW = 12


@pytest.fixture(scope="module")
def pair64(tiny_model):
    """The tiny pair (the draft skips layer 2 of 4) in float64, so that rounding stays far below any gap between two
    cumulative probabilities; an eighth of the vocabulary stops a response, so that rows end at different steps."""
    pair = load_pair(ModelSpec(path=str(tiny_model)), ModelSpec(skip_layers=[2]))
    pair.target.to(torch.float64)  # the draft holds the same parameters
    pair.target.generation_config.eos_token_id = [pair.tokenizer.eos_token_id, *range(40, 80)]
    return pair


def work_items(tokenizer) -> list[WorkItem]:
    """Rows of chat prompts of different lengths (a common beginning, the template's), longest first as the plan
    orders them; three samples of one prompt, rows of two mixing ratios."""
    texts = ["Speculative decoding drafts tokens with a small model and verifies them.", "What is 2 + 2?", "Hi",
             "def add(a, b): return a + b"]
    prompts = [tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)) for text in texts]
    items = [WorkItem(f"p{i}", 0, ids, 0.15) for i, ids in enumerate(prompts)]
    items += [WorkItem("p1", sample, prompts[1], 1.0 if sample == 2 else 0.15) for sample in (1, 2)]
    return sorted(items, key=lambda item: -len(item.prompt_ids))


def columns_agree(fast: dict[str, list], reference: dict[str, list]) -> None:
    """Tokens and flags identical, floats within rounding (features: float16's), column by column."""
    assert sorted(fast) == sorted(reference)
    for name in reference:
        for ours, theirs in zip(fast[name], reference[name], strict=True):
            ours, theirs = np.asarray(ours), np.asarray(theirs)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
            if ours.dtype.kind == "f":
                scale = np.abs(theirs).max(initial=1.0) if name == "features" else 1.0
                assert np.allclose(ours, theirs, rtol=1e-3 if name == "features" else 1e-9, atol=1e-9 * scale), name
            else:
                assert np.array_equal(ours, theirs), name


def test_the_pass_lays_out_only_a_draft_of_the_targets_own_modules_that_skips_a_layer(pair64):
    target, draft = pair64.target, pair64.draft
    layout = derived_layout(target, draft, None)
    assert layout is not None and (layout.kept, layout.shared) == ((0, 1, 3), 2)
    copied = copy.deepcopy(draft)  # the same weights in other tensors: the pass would run the target's, not these
    assert derived_layers(copied, target) == [0, 1, 3] and derived_layout(target, copied, None) is None
    assert derived_layout(target, without_layers(target, []), None) is None  # no layer skipped: no draft to pass


@pytest.mark.parametrize("transform_name,state_layer", [("plain", None), ("warped", 1), ("greedy", 3), ("plain", 2)])
def test_one_pass_rows_are_generate_then_teacher_forced_labels(pair64, transform_name, state_layer):
    """The same responses, candidates and mixing as `generate` followed by `label_batch`, the same labels and states
    up to rounding: for the state before the skipped layer, after it, and after the final norm."""
    transform, items = TRANSFORMS[transform_name], work_items(pair64.tokenizer)
    siblings = not transform.greedy
    labeller = OnePass.build(pair64.target, pair64.draft, state_layer)
    assert labeller is not None and labeller.layout.shared == 2
    stop = stop_token_ids(pair64.target, pair64.tokenizer)
    with torch.no_grad():
        fast = labeller.run(items, transform, MAX_NEW, 7, stop, siblings=siblings, rows_per_pass=4)
        responses = BuiltinEngine(pair64.tokenizer, transform, MAX_NEW, 7).responses(pair64.target, items, CPU, 4)
        reference = label_batch(pair64.target, pair64.draft, items, responses, transform, 7,
                                pair64.tokenizer.pad_token_id, 256, True, CPU, state_layer, siblings=siblings)
    columns_agree(fast, reference)
    lengths = [len(response) for response in responses]
    assert len(set(lengths)) > 2 or transform.greedy  # rows leave the pass at different steps
    target_only = [i.target_ratio for i in items].index(1.0)
    assert not any(fast["is_draft"][target_only]) and any(itertools.chain(*fast["is_draft"]))


VOCAB, LENGTH, PROMPT, ROWS = 3, 3, [0, 1], 3000


@pytest.fixture(scope="module")
def enumerable_pair():
    """A two-layer model over three tokens and its draft without layer 1, small enough to enumerate every response."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.35,
                         tie_word_embeddings=False)
    torch.manual_seed(3)
    target = LlamaForCausalLM(config).eval().requires_grad_(False)
    return target, without_layers(target, [1])


@torch.no_grad()
def exact(model, transform: SamplingTransform, prefix: list[int]) -> np.ndarray:
    """The transformed next-token distribution after `prefix`, from a plain forward."""
    return transform.log_probs(model(torch.tensor([prefix])).logits[0, -1]).exp().double().numpy()


def expected_counts(probabilities) -> np.ndarray:
    """Expected counts of ROWS draws (normalised, as float rounding leaves the sum a hair off 1)."""
    probabilities = np.asarray(probabilities, dtype=np.float64)
    return probabilities / probabilities.sum() * ROWS


@pytest.mark.parametrize("transform", [SamplingTransform(1.0, 0, 1.0), SamplingTransform(1.2, 2, 1.0)])
def test_one_pass_responses_follow_the_target_and_candidates_the_draft(enumerable_pair, transform):
    """Chi-square of 3000 responses of one prompt against the target's distribution of every 3-token response
    (enumerated), of the first candidates against q, and the mixing rate against 1 − r."""
    target, draft = enumerable_pair
    labeller = OnePass.build(target, draft, None)
    items = [WorkItem("p", sample, tuple(PROMPT), 0.3) for sample in range(ROWS)]
    with torch.no_grad():
        rows = labeller.run(items, transform, LENGTH, 5, [])
    expected = {tail: np.prod([exact(target, transform, PROMPT + list(tail[:i]))[t] for i, t in enumerate(tail)])
                for tail in itertools.product(range(VOCAB), repeat=LENGTH)}
    support = sorted(key for key, probability in expected.items() if probability > 0)  # top-p drops some
    counts = [sum(tuple(row) == key for row in rows["target_ids"]) for key in support]
    assert sum(counts) == ROWS and len(support) >= 8
    assert chisquare(counts, expected_counts([expected[key] for key in support])).pvalue > 1e-3
    first = np.bincount([int(candidates[0]) for candidates in rows["draft_ids"]], minlength=VOCAB)
    q = exact(draft, transform, PROMPT)
    assert first[q == 0].sum() == 0 and chisquare(first[q > 0], expected_counts(q[q > 0])).pvalue > 1e-3
    drafted = sum(sum(flags) for flags in rows["is_draft"])
    assert binomtest(drafted, ROWS * LENGTH, 0.7).pvalue > 1e-3


def test_gen_labels_in_one_pass_on_a_cpu_and_falls_back_where_the_probe_fails(tiny_model, prompts_file, tmp_path,
                                                                            monkeypatch, capsys):
    """A derived pair on a CPU is labelled without `label_batch`; where the probe finds that the pass does not
    compute the model's own forward (here a decoder that scales its embeddings, as old Gemma code did), gen takes
    `generate` and `label_batch`, and the two datasets agree."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"

    def refused(*args, **kwargs):
        raise AssertionError("label_batch ran where the one-pass labeller serves")

    with monkeypatch.context() as patch:
        patch.setattr(module, "label_batch", refused)
        assert main(tiny_args(tiny_model, prompts_file, fast, "--num-prompts", "4")) == 0
    used = []
    original_build = OnePass.build

    def scaled_build(target, draft, state_layer, features=True):
        decoder = target.get_decoder()
        plain = type(decoder).forward

        def scaled(self, input_ids=None, inputs_embeds=None, **kwargs):
            embeds = self.embed_tokens(input_ids) * 2.0 if inputs_embeds is None else inputs_embeds
            return plain(self, inputs_embeds=embeds, **kwargs)

        patch_decoders = [(model.get_decoder(), scaled.__get__(model.get_decoder())) for model in (target, draft)]
        for owner, method in patch_decoders:
            owner.forward = method
        try:
            used.append(original_build(target, draft, state_layer, features))
        except ProbeFailed as failure:
            used.append(failure)
            raise
        finally:
            for owner, _ in patch_decoders:
                del owner.forward
        return used[-1]

    monkeypatch.setattr(OnePass, "build", staticmethod(scaled_build))
    capsys.readouterr()
    assert main(tiny_args(tiny_model, prompts_file, slow, "--num-prompts", "4")) == 0
    assert len(used) == 1 and isinstance(used[0], ProbeFailed)
    assert ("the one-pass labeller cannot run LlamaForCausalLM (its p, q or states differ from the model's own "
            "forwards)") in capsys.readouterr().err
    a, b = load_labelled(fast), load_labelled(slow)
    assert a["target_ids"] == b["target_ids"] and a["is_draft"] == b["is_draft"]
    assert np.allclose(np.concatenate([np.asarray(x) for x in a["logp"]]),
                       np.concatenate([np.asarray(x) for x in b["logp"]]), atol=1e-5)


def test_data_labelled_before_the_mixing_stream_is_told_apart(tiny_model, prompts_file, tmp_path, capsys):
    """The fingerprint records the labeller: a dataset of the earlier labeller (its mixing from the label stream) is
    not resumed into, and the refusal names `labeller`."""
    out = tmp_path / "data"
    args = tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2")
    assert main(args) == 0
    manifest = read_manifest(out)
    assert manifest["identity"]["labeller"] == LABELLER == 3
    old = {name: value for name, value in manifest["identity"].items() if name != "labeller"}
    (out / MANIFEST).write_text(json.dumps({**manifest, "identity": old, "fingerprint": fingerprint_of(old)}))
    capsys.readouterr()
    assert main(args) == 2
    assert "differs in: labeller" in capsys.readouterr().err
