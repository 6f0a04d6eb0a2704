"""`generate(custom_generate=speculative_generate, prompt_lookup_num_tokens=K)`: transformers' prompt lookup argument,
drafted from the context and verified exactly, with or without a token head: greedy token for token the target's own
generate (and transformers' own prompt lookup), sampling the target's distribution (chi-square, batched)."""

from __future__ import annotations

import pytest
import torch
from test_eval import chi_square_p
from test_lookup_decoding import LENGTH, PROMPT, VOCAB, exact, target  # noqa: F401  (fixtures)

from specheads.decoding.free_draft import LookupDraft
from specheads.integrations.transformers import speculative_generate
from specheads.lookup.features import FEATURE_NAMES
from specheads.lookup.token_head import FORMAT, STOP, TokenHead, expected_shapes
from specheads.plumbing.errors import UsageError


@pytest.fixture(scope="module")
def model(target):  # noqa: F811  (the fixture of test_lookup_decoding)
    """The chi-square target with no EOS and no pad id (a pad id would mask the prompt's own tokens of that id)."""
    config = target.generation_config
    config.eos_token_id = config.bos_token_id = config.pad_token_id = None
    return target


def token_head(seed: int = 0) -> TokenHead:
    """A token-only stop head with random weights (its estimates vary with the proposal and the request's history),
    as TokenHead.load gives it."""
    config = {"format": FORMAT, "head_type": STOP, "inputs": list(FEATURE_NAMES), "width": 8, "depth": 1,
              "draft_kind": "lookup"}
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in expected_shapes(config).items()}
    tensors["feature_mean"].zero_()
    tensors["feature_std"].fill_(1.0)
    tensors["out.weight"].mul_(0.05)
    tensors["out.bias"].fill_(-1.0)  # estimates around 0.05-0.2: it verifies nothing or one proposed token
    return TokenHead(config, tensors)


def sampled(model, runs: int = 8, rows: int = 100, **kwargs) -> list[tuple[int, ...]]:
    torch.manual_seed(0)
    samples = []
    for _ in range(runs):
        out = model.generate(torch.tensor([PROMPT] * rows), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=LENGTH, custom_generate=speculative_generate, **kwargs)
        samples += [tuple(row[len(PROMPT):]) for row in out.tolist()]
    return samples


@pytest.mark.parametrize("head", [None, "token head"])
def test_prompt_lookup_through_generate_samples_the_target_distribution(model, exact, head):  # noqa: F811
    stats: list = []
    samples = sampled(model, prompt_lookup_num_tokens=3, head=token_head() if head else None, stats=stats)
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)  # proposals made, some rejected
    if head:  # the head's verify lengths vary with the proposal and the history
        assert {0, 1} <= {n for s in stats for n in s.drafted_per_round}  # it skips some rounds, verifies others
    p_value = chi_square_p(samples, exact)
    print(f"generate, prompt lookup, head {head}: p = {p_value:.3g}")
    assert p_value > 1e-3


def test_greedy_prompt_lookup_is_the_targets_own_generate_token_for_token(model):
    batch = torch.tensor([PROMPT, [2, 2, 1, 2, 2, 1, 2, 2], [1, 1, 2, 1, 1, 2, 1, 1]])
    own = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=20).tolist()
    for kwargs in ({}, {"head": token_head()}, {"draft": LookupDraft("ngram", max_ngram=3)}):
        stats: list = []
        ours = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=20,
                              custom_generate=speculative_generate, prompt_lookup_num_tokens=4, stats=stats, **kwargs)
        assert ours.tolist() == own, kwargs
        assert sum(s.draft_forwards for s in stats) == 0
        assert sum(s.accepted for s in stats) > 0
    single = torch.tensor([PROMPT])  # transformers' own prompt lookup (batch size 1), the same tokens
    theirs = model.generate(single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=20,
                            prompt_lookup_num_tokens=4)
    assert theirs.tolist() == own[:1]


def test_prompt_lookup_refusals(model):
    ids = torch.tensor([PROMPT])
    with pytest.raises(UsageError, match="drop draft="):
        model.generate(ids, max_new_tokens=3, custom_generate=speculative_generate, prompt_lookup_num_tokens=3,
                       draft=model)
    with pytest.raises(UsageError, match="estimates each proposed token"):
        model.generate(ids, max_new_tokens=3, custom_generate=speculative_generate, prompt_lookup_num_tokens=3,
                       head="not a head")
    with pytest.raises(UsageError, match="prompt_lookup_num_tokens=K"):
        model.generate(ids, max_new_tokens=3, custom_generate=speculative_generate, draft=LookupDraft())
    assert VOCAB == 3


@pytest.mark.integration
def test_prompt_lookup_on_the_embedded_target_is_its_own_greedy_and_copies_several_tokens_a_round():
    """SmolLM2 asked to repeat a function: generate's prompt lookup (ours and transformers' own) gives the target's
    greedy tokens, and rounds accept several proposed tokens; so does a suffix draft through the round engine."""
    from specheads.decoding import RoundEngine, make_policy
    from specheads.lookup.proposers import suffix_available
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import ModelSpec, load_pair

    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(skip_layers=[20, 21]))
    code = "def add(first, second):\n    total = first + second\n    return total\n"
    messages = [{"role": "user", "content": f"Repeat this code exactly, then stop:\n{code}"}]
    prompt = pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([list(prompt)])
    mask = torch.ones_like(ids)
    own = pair.target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24).tolist()
    stats: list = []
    ours = pair.target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                                custom_generate=speculative_generate, prompt_lookup_num_tokens=8, stats=stats)
    theirs = pair.target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                                  prompt_lookup_num_tokens=8)
    assert ours.tolist() == own == theirs.tolist()
    assert max(stats[0].accepted_per_round) > 2 and stats[0].target_calls < stats[0].emitted
    if suffix_available():
        eos = pair.target.generation_config.eos_token_id
        engine = RoundEngine(pair.target, LookupDraft("suffix"), SamplingTransform(0.0),
                             stop_ids=eos if isinstance(eos, list) else [eos])
        result = engine.decode_one(list(prompt), make_policy("suffix_own", 0.1, max_draft=8), 24, 0)
        assert result.tokens == own[0][len(prompt):] and max(result.accepted_per_round) > 2
