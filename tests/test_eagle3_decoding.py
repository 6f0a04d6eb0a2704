"""EAGLE-3 drafts in the decoding core (`specheads.decoding.eagle3`): the output follows the target's distribution
(chi-square on an enumerable tiny target, a drafter of speculators' classes whose vocabulary lacks a token), greedy
decoding gives the target's own tokens, and the cached drafter computes what speculators' training forward computes."""

import pytest
import torch
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.model_outputs.sampling import SamplingTransform

pytest.importorskip("speculators.models.eagle3")

from specheads.decoding.eagle3 import Eagle3Draft, Eagle3Target, eagle3_decode  # noqa: E402
from specheads.pair.eagle3 import build_drafter, fill_from_target, target_features  # noqa: E402


def random_drafter(target, layer_ids, d2t, t2d, seed=0, std=0.5):
    """A drafter of speculators' classes with random trained weights (its head too), filled from `target`."""
    drafter = build_drafter(target.config, layer_ids, len(d2t), "tiny")
    fill_from_target(drafter, target, torch.tensor(d2t), torch.tensor(t2d))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if parameter.requires_grad or name == "lm_head.weight":
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std + (1.0 if "norm" in name else 0.0))
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny_eagle():
    target = tiny_lm(seed=1)
    # the draft vocabulary is tokens 0 and 2: q(1) = 0 everywhere, the target's p(1) is real mass
    return target, random_drafter(target, [0, 1, 2], d2t=[0, 1], t2d=[True, False, True])


def test_eagle3_drafts_sample_the_target_distribution(tiny_eagle):
    target, drafter = tiny_eagle
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    for max_draft in (1, 3):
        results = [eagle3_decode(target, drafter, PROMPT, transform, max_draft, LENGTH, seed) for seed in range(600)]
        samples = [tuple(result.tokens) for result in results]
        assert chi_square_p(samples, exact) > 1e-3, max_draft
        accepted = sum(sum(result.accepted) for result in results)
        assert 0 < accepted < sum(sum(result.reached) for result in results)  # some drafts stand, some do not


def test_greedy_eagle3_decoding_gives_the_targets_greedy_tokens(tiny_model):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    kept = list(range(0, vocabulary, 3))
    drafter = random_drafter(target, [1, 2, 3], [t - i for i, t in enumerate(kept)],
                             [i in set(kept) for i in range(vocabulary)], std=0.3)
    prompt = [5, 9, 30, 41]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    result = eagle3_decode(target, drafter, prompt, SamplingTransform(0.0), 4, 20, seed=0)
    assert result.tokens == expected and result.target_calls == result.rounds + 1


def test_the_cached_drafter_computes_what_speculators_training_forward_computes(tiny_model):
    """speculators trains a drafter with one masked forward over a whole sequence, three drafted steps at once; the
    decoding core feeds it through a KV cache, the verified positions with the target's features and the drafted ones
    with its own states. Both must give the same logits for the same inputs."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    kept = list(range(0, 128))
    drafter = random_drafter(target, [1, 2, 3], [t - i for i, t in enumerate(kept)],
                             [i in set(kept) for i in range(vocabulary)], std=0.3)
    tokens = [5, 9, 30, 41, 7, 12, 60, 3, 99, 14]
    aux, _ = target_features(target, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), [1, 2, 3])
    captured = []
    hook = drafter.lm_head.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    size = len(tokens) - 1  # speculators' shifted layout: token t + 1 with the features of t, positions from 1
    with torch.no_grad():
        drafter(hidden_states=aux[:, :size], input_ids=torch.tensor([tokens[1:]]), document_ids=torch.zeros(1, size, dtype=torch.long),
                position_ids=torch.arange(1, size + 1).unsqueeze(0), ttt_steps=3)
    hook.remove()
    for verified in (3, 6):  # positions 0..verified−1 stand; the drafted tokens are the sequence's next ones
        draft = Eagle3Draft(drafter, vocabulary)
        verifier = Eagle3Target(target, [1, 2, 3])
        verifier.feed(tokens[:verified])
        logits, own = draft.feed(tokens[1:verified], verifier.features[: verified - 1], fused=True)
        index = verified - 2  # speculators' row of position verified − 1
        assert torch.allclose(logits[-1], captured[0][index].float(), atol=1e-4)
        for step in (1, 2):
            logits, own = draft.feed([tokens[verified - 1 + step]], own[-1:], fused=False)
            assert torch.allclose(logits[-1], captured[step][index].float(), atol=1e-4), (verified, step)


def test_every_round_feeds_the_drafter_the_target_features_of_the_position_before_each_token(tiny_model, monkeypatch):
    """As vLLM's proposer: a token read with the target's features gets those of the position before it, computed on
    the standing tokens; a drafted token gets the drafter's own state."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocabulary = target.config.vocab_size
    drafter = random_drafter(target, [1, 2, 3], [0] * 64, [i < 64 for i in range(vocabulary)], std=0.3)
    fed = []
    original = Eagle3Draft.feed

    def recording(self, tokens, features, fused):
        fed.append((self.first_position + self.length, list(tokens), features.clone(), fused))
        return original(self, tokens, features, fused)

    monkeypatch.setattr(Eagle3Draft, "feed", recording)
    prompt = [5, 9, 30, 41]
    result = eagle3_decode(target, drafter, prompt, SamplingTransform(1.0), 3, 16, seed=3)
    sequence = prompt + result.tokens
    aux, _ = target_features(target, torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.long), [1, 2, 3])
    catch_ups = [(start, tokens, features) for start, tokens, features, fused in fed if fused]
    assert len(catch_ups) == result.rounds and catch_ups[0][0] == 1 and result.rounds > 2
    covered = 1
    for start, tokens, features in catch_ups:  # every position read once with the target's features, in order
        assert start == covered and tokens == sequence[start:start + len(tokens)]
        assert torch.allclose(features, aux[0, start - 1:start - 1 + len(tokens)], atol=1e-4)
        covered = start + len(tokens)
    assert covered <= len(sequence) and sum(not fused for *_, fused in fed) == result.draft_forwards - result.rounds
