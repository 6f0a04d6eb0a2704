"""Modelled speedups come from counted forwards: each loop's counts against forwards counted by hooks on the models
(a head's forwards too, each at its weights over the draft's), Eq. 5.1 only where the SpecDec++ loop's accounting
holds, and runs that end at a stop token inside a round."""

import pytest
import torch
from test_eval import tiny_lm

from specheads.decoding import DecodeResult, RoundEngine, make_policy
from specheads.decoding.companion import head_forward_cost
from specheads.eval.sweep import DecodePrompt, RunRecord, Setting, aggregate, as_oracle, eq_5_1_speedup, record_of
from specheads.heads import LinearVerifier, OnTimeAcceptanceHead, ResNetAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform

VOCAB = 12
PROMPTS = [[1, 2, 3], [4, 5], [7, 1, 1, 9], [2], [11, 3, 6], [8, 8]]
C = 0.2


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(seed=21, vocab=VOCAB, init=0.5), tiny_lm(seed=22, vocab=VOCAB, init=0.5)


def heads() -> dict[str, torch.nn.Module]:
    torch.manual_seed(4)
    lagged = ResNetAcceptanceHead(16, depth=1, extra_features=["logq", "entropy"]).eval()
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    for head in (lagged, on_time):
        torch.nn.init.normal_(head.out.weight, std=1.5)
    return {"lagged": lagged, "on_time": on_time}


class ForwardCounter:
    """Counts the forwards a model's decoder makes, by a hook on it (the loops call the decoder once per forward)."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self.handle = model.get_decoder().register_forward_hook(self._seen)

    def _seen(self, *_: object) -> None:
        self.count += 1

    def __enter__(self) -> "ForwardCounter":
        return self

    def __exit__(self, *_: object) -> None:
        self.handle.remove()


def record(setting: Setting, prompt_id: str, result: DecodeResult) -> RunRecord:
    return record_of(setting, DecodePrompt(prompt_id, (), "test"), result, -1.0)


STOP_SETTINGS = [("constant_k", 3, None), ("svip", 1.2, None), ("confidence", 0.3, None), ("head", 0.5, "lagged"),
                 ("head", 0.4, "on_time")]


@pytest.mark.parametrize("name,threshold,head_name", STOP_SETTINGS)
def test_the_specdecpp_loop_counts_its_forwards_and_its_counted_speedup_is_eq_5_1_plus_the_heads(pair, name, threshold,
                                                                                                 head_name):
    """Without a head the counted speedup is Eq. 5.1; a head scores every candidate (on time) or all but each round's
    last (one step late), and each score is charged at the head's weights over the draft's, which Eq. 5.1 leaves out."""
    target, draft = pair
    decoder = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    head = heads().get(head_name)
    policy = make_policy(name, threshold, max_draft=4)
    records, whole_rounds = [], 0
    for number, prompt in enumerate(PROMPTS):
        with ForwardCounter(draft) as drafts, ForwardCounter(target) as targets:
            result = decoder.decode_one(prompt, policy, 20, seed=number, head=head)
        assert (result.draft_forwards, result.target_calls) == (drafts.count, targets.count)
        assert result.draft_forwards == result.drafted  # one draft forward per drafted token
        unscored = 0 if head_name != "lagged" else sum(k > 0 for k in result.drafted_per_round)
        assert result.head_scored == (0 if head is None else result.drafted - unscored)
        assert result.head_forwards == pytest.approx(0 if head is None else result.head_scored * head_forward_cost(head, draft))
        assert result.emitted == len(result.tokens) == 20
        assert result.target_calls == len(result.accepted_per_round)
        # every round emits its accepted candidates and one token of the target's, except a last round whose bonus
        # token falls beyond max_new_tokens
        assert result.emitted in (result.accepted + result.target_calls, result.accepted + result.target_calls - 1)
        if result.emitted == result.accepted + result.target_calls:
            whole_rounds += 1
            records.append(record(Setting(name, threshold), f"p{number}", result))
    assert whole_rounds >= 2
    row = aggregate(records, "test", C, None)[0]
    emitted = sum(r.emitted for r in records)
    charged = sum(r.draft_forwards + r.head_forwards for r in records)
    by_hand = emitted / (C * charged + sum(r.target_calls for r in records))
    assert row["modelled_speedup"] == pytest.approx(by_hand)
    eq_5_1 = eq_5_1_speedup(row["discard_rate"], row["verification_rate"], C)
    if head is None:
        assert row["modelled_speedup"] == pytest.approx(eq_5_1)
    else:  # lower by the head's forwards: 1/S = 1/S_5.1 + c · head forwards / token
        assert 1 / row["modelled_speedup"] == pytest.approx(1 / eq_5_1 + C * sum(r.head_forwards for r in records) / emitted)
        assert row["modelled_speedup"] < eq_5_1


def test_the_oracle_counts_one_draft_forward_per_accepted_candidate(pair):
    target, draft = pair
    decoder = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    runs = [decoder.decode_one(prompt, make_policy("constant_k", 4), 20, seed=n) for n, prompt in enumerate(PROMPTS)]
    oracle = [as_oracle(record(Setting("constant_k", 4.0), f"p{n}", run)) for n, run in enumerate(runs)]
    assert all(r.draft_forwards == r.accepted == sum(r.accepted_per_round) for r in oracle)
    assert sum(r.draft_forwards for r in oracle) < sum(run.draft_forwards for run in runs)  # K = 4 does discard here
    row = aggregate(oracle, "test", C, None)[0]
    tokens, calls = sum(r.emitted for r in oracle), sum(r.target_calls for r in oracle)
    assert row["discard_rate"] == 0
    assert row["modelled_speedup"] == pytest.approx(tokens / (C * sum(r.accepted for r in oracle) + calls))


def test_sprinter_is_counted_one_draft_forward_per_token_and_eq_5_1_would_overstate_it(pair):
    target, draft = pair
    decoder = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    torch.manual_seed(6)
    verifier = LinearVerifier(16, extra_features=["logq"]).eval()
    torch.nn.init.normal_(verifier.out.weight, std=1.0)
    records = []
    for number, prompt in enumerate(PROMPTS):
        with ForwardCounter(draft) as drafts, ForwardCounter(target) as targets:
            result = decoder.decode_one(prompt, make_policy("sprinter", 0.5), 20, seed=number, head=verifier)
        assert (result.draft_forwards, result.target_calls) == (drafts.count, targets.count)
        assert result.draft_forwards == result.emitted == result.drafted == 20  # the draft proposes every token
        assert result.head_scored == 20  # and the verifier scores each
        records.append(record(Setting("sprinter", 0.5), f"p{number}", result))
    calls = sum(r.target_calls for r in records)
    rejected = sum(r.drafted - r.accepted for r in records)
    assert 0 < rejected < calls < sum(r.emitted for r in records)  # some tokens verified and kept, some passed
    row = aggregate(records, "test", C, None)[0]
    assert row["modelled_speedup"] == pytest.approx(1 / (C * (1 + head_forward_cost(verifier, draft)) + calls / row["tokens"]))
    assert row["modelled_speedup"] < eq_5_1_speedup(row["discard_rate"], row["verification_rate"], C)


STOPS = [3, 7]


def test_a_run_ends_at_the_first_stop_token_inside_a_round_and_counts_nothing_after_it(pair):
    target, draft = pair
    transform = SamplingTransform(1.0)
    decoder = RoundEngine(target, draft, transform, stop_ids=STOPS)
    free = RoundEngine(target, draft, transform, stop_ids=[])
    torch.manual_seed(6)
    verifier = LinearVerifier(16).eval()
    ended_inside_a_round = 0
    for name, threshold, head_name in STOP_SETTINGS + [("oracle", 4, None), ("sprinter", 0.5, None)]:
        head = heads().get(head_name)
        for seed in range(8):
            prompt = PROMPTS[seed % len(PROMPTS)]
            if name == "sprinter":
                def decode(loop: RoundEngine, prompt=prompt, seed=seed):
                    return loop.decode_one(prompt, make_policy("sprinter", 0.5), 24, seed, verifier)
            else:
                policy = make_policy(name, threshold, 4)

                def decode(loop: RoundEngine, prompt=prompt, seed=seed, policy=policy, head=head):
                    return loop.decode_one(prompt, policy, 24, seed, head)
            with ForwardCounter(draft) as counter:
                run = decode(decoder)
            forwards, unstopped = counter.count, decode(free)
            stops = [i for i, token in enumerate(run.tokens) if token in STOPS]
            # the oracle counts the forwards it would have made, one per kept candidate (eval's `as_oracle`)
            assert run.emitted == len(run.tokens) and run.draft_forwards == (run.accepted if name == "oracle" else forwards), name
            assert stops in ([], [len(run.tokens) - 1]), name  # at most one stop token, and it ends the output
            first = next((i for i, token in enumerate(unstopped.tokens) if token in STOPS), None)
            # the same draws up to the stop token: the output is the unstopped run's, cut just after it
            assert run.tokens == unstopped.tokens[: len(unstopped.tokens) if first is None else first + 1], name
            assert run.accepted <= run.emitted, name
            if stops and name != "sprinter" and len(run.tokens) < 24:
                # the stop token was an accepted candidate: the round ended there, without the target's token
                ended_inside_a_round += run.emitted == run.accepted + run.target_calls - 1
    assert ended_inside_a_round > 0
