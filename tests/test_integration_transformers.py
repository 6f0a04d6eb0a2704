"""specheads.integrations.transformers: a head drives `target.generate(custom_generate=...)` exactly (greedy token for
token, sampling by the chi-square test), honours generate's stopping criteria and a streamer, and refuses in one
line what it cannot honour."""

import pytest
import torch
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import TopPLogitsWarper

from specheads.heads import LinearVerifier, OnTimeAcceptanceHead
from specheads.heads.loading import DecisionRule
from specheads.integrations.transformers import speculative_generate
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


def quiet_pair() -> tuple:
    """A 3-token target and draft that disagree (the chi-square test's pair), with no EOS: every run is LENGTH long."""
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    for model in (target, draft):
        model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
        model.generation_config.bos_token_id = None
    return target, draft


def near_pair() -> tuple:
    """A 32-token target and a draft that is its weights plus noise, so that rounds often keep several tokens."""
    target, draft = tiny_lm(seed=3, vocab=32, init=0.6), tiny_lm(seed=3, vocab=32, init=0.6)
    torch.manual_seed(4)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(0.1 * weight.std() * torch.randn_like(weight))
    for model in (target, draft):
        model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = 0
    return target, draft


def sampled_through_generate(target, draft, head, runs: int = 5, rows: int = 100) -> list[tuple[int, ...]]:
    """`runs` × `rows` samples of LENGTH tokens after PROMPT through generate(custom_generate=speculative_generate) at
    T = 1 (torch's global seed 0 first): the chi-square tests' draws."""
    torch.manual_seed(0)
    samples = []
    for _ in range(runs):
        out = target.generate(torch.tensor([PROMPT] * rows), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=LENGTH, custom_generate=speculative_generate, draft=draft, head=head)
        samples += [tuple(row[len(PROMPT):]) for row in out.tolist()]
    return samples


@pytest.fixture(scope="module")
def pair():
    return quiet_pair()


@pytest.fixture(scope="module")
def wide_pair():
    return near_pair()


def head_for(sampling: SamplingTransform | None, threshold: float = 0.5, max_draft: int = 3):
    """A random on-time head (stop decisions that vary with the state), as load_head returns it."""
    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(head.out.weight, std=2.0)
    if sampling is not None:  # as load_head sets it from config.json (which records max_new_tokens beside the transform)
        head.trained_for = {"sampling": {**sampling.as_dict(), "max_new_tokens": 64}}
    return head, DecisionRule("stop_drafting_when_rejection_risk_above", threshold, True, max_draft=max_draft)


def test_greedy_output_is_token_for_token_the_targets_own_generate(wide_pair):
    target, draft = wide_pair
    head = head_for(SamplingTransform(0.0))
    prompts = [[5, 9, 1], [30, 2, 2, 7, 11], [4]]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        plain = target.generate(ids, do_sample=False, max_new_tokens=20)
        stats = []
        ours = target.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=speculative_generate,
                               draft=draft, head=head, stats=stats)
        assert ours.tolist() == plain.tolist()
        assert stats[0].emitted == 20 and 0 < stats[0].target_calls < 20  # rounds kept more than one token
    # a left-padded batch decodes each row as it decodes alone
    batch = torch.tensor([[0, 0, 5, 9, 1], [30, 2, 2, 7, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    together = target.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=12,
                               custom_generate=speculative_generate, draft=draft, head=head)
    for row, prompt in enumerate(([5, 9, 1], [30, 2, 2, 7, 11])):
        alone = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
        assert together[row, -12:].tolist() == alone[0, -12:].tolist()


def test_sampling_through_generate_leaves_the_target_distribution_unchanged(pair):
    """500 samples (5 generate calls of 100 rows, each row its own generator) against the enumerated target."""
    target, draft = pair
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    head = head_for(transform)
    samples = sampled_through_generate(target, draft, head)
    assert chi_square_p(samples, exact) > 1e-3
    torch.manual_seed(0)  # torch's global seed repeats a run
    again = target.generate(torch.tensor([PROMPT] * 100), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=LENGTH, custom_generate=speculative_generate, draft=draft, head=head)
    assert [tuple(row[len(PROMPT):]) for row in again.tolist()] == samples[:100]
    several = target.generate(torch.tensor([PROMPT]), do_sample=True, top_k=0, num_return_sequences=4, max_new_tokens=LENGTH,
                              custom_generate=speculative_generate, draft=draft, head=head)
    assert several.shape == (4, len(PROMPT) + LENGTH)  # independent samples, a generator each


class StopAfter(StoppingCriteria):
    """Ends a sequence once `token` is its last token (a caller's own criterion)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class Collect:
    """A streamer that keeps what it is sent."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.ended = True


def test_stopping_criteria_eos_and_the_streamer_end_where_the_target_alone_ends(wide_pair):
    target, draft = wide_pair
    head = head_for(SamplingTransform(0.0))
    ids = torch.tensor([[5, 9, 1]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)[0, 3:].tolist()
    stop = plain[6]  # a token the greedy run reaches mid-way
    first = plain.index(stop)
    criteria = StoppingCriteriaList([StopAfter(stop)])
    streamer = Collect()
    ours = target.generate(ids, do_sample=False, max_new_tokens=20, stopping_criteria=criteria,
                           custom_generate=speculative_generate, draft=draft, head=head, token_streamer=streamer)
    assert ours[0, 3:].tolist() == plain[: first + 1]
    assert streamer.tokens == [5, 9, 1] + plain[: first + 1] and streamer.ended  # the prompt first, as generate does
    by_eos = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=stop,
                             custom_generate=speculative_generate, draft=draft, head=head)
    assert by_eos[0, 3:].tolist() == plain[: first + 1]


@pytest.mark.parametrize("options, message", [
    ({"repetition_penalty": 1.3, "do_sample": True}, "logits processor RepetitionPenaltyLogitsProcessor"),
    ({"do_sample": True, "temperature": 0.7}, "trained for sampling"),
    ({"do_sample": True, "top_k": 0, "logits_processor": LogitsProcessorList([TopPLogitsWarper(0.9)]), "temperature": 0.7},
     "out of that order"),
    ({"do_sample": False, "output_scores": True, "return_dict_in_generate": True}, "drop return_dict_in_generate"),
])
def test_options_it_cannot_honour_are_refused_in_one_line(pair, options, message):
    target, draft = pair
    head = head_for(SamplingTransform(1.0))
    with pytest.raises(UsageError, match=message):
        target.generate(torch.tensor([PROMPT]), max_new_tokens=2, custom_generate=speculative_generate, draft=draft,
                        head=head, **options)


def test_a_missing_draft_a_verifier_and_a_head_for_another_draft_are_refused(pair, wide_pair):
    target, draft = pair
    ids = torch.tensor([PROMPT])
    with pytest.raises(UsageError, match="draft=<the draft model>"):
        target.generate(ids, max_new_tokens=2, custom_generate=speculative_generate, assistant_model=draft,
                        head=head_for(None))
    verifier = (LinearVerifier(16), DecisionRule("call_target_when_acceptance_below", 0.5, True))
    with pytest.raises(UsageError, match="SPRINTER verifier"):
        target.generate(ids, max_new_tokens=2, custom_generate=speculative_generate, draft=draft, head=verifier)
    wider = OnTimeAcceptanceHead(24, depth=1, extra_features=["logq"])
    with pytest.raises(UsageError, match="draft states of size 24"):
        target.generate(ids, max_new_tokens=2, custom_generate=speculative_generate, draft=draft, head=wider)
