"""A draft whose output layer has another number of rows than the target's (padded vocabularies, as Qwen2.5-0.5B's
151 936 beside Qwen2.5-7B's 152 064) decodes exactly: the target's extra rows keep their probability (the residual
and the bonus draw give them), the draft's extra rows are never proposed; greedy is token for token the target's own
generate, through the round engine and through `target.generate(custom_generate=...)`."""

import itertools

import numpy as np
import pytest
import torch
from test_eval import PROMPT, chi_square_p, tiny_lm
from test_integration_transformers import head_for

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.heads import OnTimeAcceptanceHead
from specheads.integrations.transformers import speculative_generate
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError

LENGTH = 3
RUNS = 600


@torch.no_grad()
def enumerated(model, vocab: int, transform: SamplingTransform) -> dict[tuple[int, ...], float]:
    """The exact distribution of LENGTH tokens after PROMPT over the model's `vocab` tokens."""
    result = {}
    for tail in itertools.product(range(vocab), repeat=LENGTH):
        log_probs = transform.log_probs(model(torch.tensor([PROMPT + list(tail)])).logits[0])
        result[tail] = float(np.prod([log_probs[len(PROMPT) - 1 + i, t].exp().item() for i, t in enumerate(tail)]))
    return result


def quiet(*models):
    for model in models:
        model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
        model.generation_config.bos_token_id = None
    return models


def engine_samples(target, draft, policy, head=None) -> list[tuple[int, ...]]:
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    return [tuple(r.tokens) for first in range(0, RUNS, 100)
            for r in engine.decode([PROMPT] * 100, policy, LENGTH, list(range(first, first + 100)), head)]


def test_a_target_with_rows_beyond_the_drafts_keeps_their_probability_through_the_engine_and_generate():
    """Target 4 rows, draft 3: the draft never proposes token 3, the target's p gives it about a third of the
    sequences, and the output follows the target's distribution whatever the rule."""
    target, draft = quiet(tiny_lm(seed=1, vocab=4), tiny_lm(seed=2, vocab=3))
    exact = enumerated(target, 4, SamplingTransform(1.0))
    assert sum(p for tail, p in exact.items() if 3 in tail) > 0.2  # the extra row holds real mass
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16)
    torch.nn.init.normal_(head.out.weight, std=2.0)
    for name, threshold, with_head in (("constant_k", 2, None), ("head", 0.5, head), ("oracle", 2, None)):
        samples = engine_samples(target, draft, make_policy(name, threshold, max_draft=2), with_head)
        assert any(3 in s for s in samples), name
        assert chi_square_p(samples, exact) > 1e-3, name
    exported = head_for(SamplingTransform(1.0))  # (it seeds torch: made before the runs' seed)
    torch.manual_seed(0)
    samples = []
    for _ in range(RUNS // 100):
        out = target.generate(torch.tensor([PROMPT] * 100), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=LENGTH, custom_generate=speculative_generate, draft=draft, head=exported)
        samples += [tuple(row[len(PROMPT):]) for row in out.tolist()]
    assert chi_square_p(samples, exact) > 1e-3, "generate"


def test_a_draft_with_rows_beyond_the_targets_never_proposes_them():
    """Draft 4 rows, target 3: q is renormalised over the target's tokens, so a candidate is always one the target
    can check, and the output follows the target's distribution."""
    target, draft = quiet(tiny_lm(seed=1, vocab=3), tiny_lm(seed=2, vocab=4))
    exact = enumerated(target, 3, SamplingTransform(1.0))
    samples = engine_samples(target, draft, make_policy("constant_k", 2))
    assert chi_square_p(samples, exact) > 1e-3


def resized_draft(target, rows: int, noise: float = 0.1):
    """The target's weights plus noise in a model of `rows` vocabulary rows: its first rows are the target's, rows
    beyond the target's are the fresh model's (three times their scale, so that they would often win its argmax)."""
    draft = tiny_lm(seed=0, vocab=rows, init=target.config.initializer_range)
    shared = min(rows, target.config.vocab_size)
    with torch.no_grad():
        for name, weight in draft.state_dict().items():
            source = target.state_dict()[name]
            if weight.shape[:1] == (rows,):
                weight[shared:] *= 3.0
                weight[:shared] = source[:shared]
            else:
                weight.copy_(source)
        torch.manual_seed(4)
        for weight in draft.parameters():
            weight.add_(noise * weight.std() * torch.randn_like(weight))
    return draft


@pytest.mark.parametrize("target_rows, draft_rows", [(40, 32), (32, 40)])
def test_greedy_with_padded_rows_is_token_for_token_the_targets_generate(target_rows, draft_rows):
    target = tiny_lm(seed=3, vocab=target_rows, init=0.6)
    with torch.no_grad():  # the target's padded rows take the argmax now and then
        target.lm_head.weight[min(target_rows, draft_rows):] *= 1.5
    draft = resized_draft(target, draft_rows)
    for model in (target, draft):
        model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = 0
    engine = RoundEngine(target, draft, SamplingTransform(0.0), stop_ids=[])
    reached = False
    for prompt in ([5, 9, 1], [30, 2, 2, 7, 11], [4]):
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)
        ours = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                               custom_generate=speculative_generate, draft=draft, head=head_for(SamplingTransform(0.0)))
        assert ours.tolist() == plain.tolist(), prompt
        result = engine.decode_one(prompt, make_policy("constant_k", 4), 20, seed=0)
        assert result.tokens == plain[0, len(prompt):].tolist() and result.target_calls < 20
        reached |= any(token >= min(target_rows, draft_rows) for token in result.tokens)
    if target_rows > draft_rows:
        assert reached  # the target's padded rows were emitted (and then read by the draft as its stand-in id)


def test_tree_drafts_refuse_a_draft_of_another_vocabulary_size_in_one_line():
    target, draft = tiny_lm(seed=1, vocab=4), tiny_lm(seed=2, vocab=3)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    with pytest.raises(UsageError, match="tree drafts need a draft that predicts the target's 4 tokens"):
        decode_tree(engine, [PROMPT], TreeRule("confidence", 0.0, budget=4), LENGTH, [0])
