"""What the round engine counts and what its rules see: no candidate is drafted for the slot the bonus token fills,
transformers' default rule drafts as its assisted generation does, run-time rules observe no candidate past the stop
token that ended a request, and the oracle decoded by the engine is counted as eval counts it."""

import torch
from test_eval import PROMPT, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.online import PassivePlanner
from specheads.decoding.rules import Drafted
from specheads.eval.sweep import Setting, as_oracle, record_of
from specheads.model_outputs.sampling import SamplingTransform

GREEDY_PROMPT = [1, 2, 3]  # no 0: generate's pad_token_id=0 would mask it out of the reference run


def same_pair():
    """A draft equal to the target: under greedy decoding every candidate is accepted."""
    pair = tiny_lm(seed=3, vocab=11), tiny_lm(seed=3, vocab=11)
    for model in pair:
        model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    return pair


def test_no_candidate_is_drafted_for_the_last_slot_the_bonus_token_fills():
    """K = 4, 12 tokens, every candidate accepted: rounds of 4 + bonus, 4 + bonus, then 1 + bonus; a second candidate
    in the last round could only have taken the bonus token's place (10 draft forwards before, 9 now)."""
    target, draft = same_pair()
    greedy = target.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    engine = RoundEngine(target, draft, SamplingTransform(0.0), stop_ids=[])
    result = engine.decode_one(GREEDY_PROMPT, make_policy("constant_k", 4), 12, seed=0)
    assert result.tokens == greedy
    assert (result.draft_forwards, result.target_calls, result.accepted_per_round) == (9, 3, [4, 4, 1])
    one = engine.decode_one(GREEDY_PROMPT, make_policy("constant_k", 4), 1, seed=0)
    assert one.tokens == greedy[:1] and (one.draft_forwards, one.target_calls) == (0, 1)  # the target's token alone


def test_transformers_default_drafts_one_fewer_than_the_tokens_left_and_stops_at_a_stop_token():
    rule = make_policy("transformers", 0.4)
    assert (rule.cap(100), rule.cap(12), rule.cap(1)) == (20, 11, 0)  # min(20, max_length − length − 1)
    assert rule.stop(Drafted(index=1, prob=1.0, entropy=0.0, acceptance=1.0, ends_output=True))
    assert not rule.stop(Drafted(index=1, prob=1.0, entropy=0.0, acceptance=1.0))


class Observer(PassivePlanner):
    """Keeps every outcome a run-time rule is shown."""

    def __init__(self):
        self.seen = []

    def observe(self, outcomes):
        self.seen += [o.position for checked in outcomes.values() for o in checked]


def test_a_run_time_rule_observes_nothing_past_the_accepted_stop_token_that_ended_the_request():
    target, draft = same_pair()
    greedy = target.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    stop = greedy[1]
    assert stop not in greedy[:1]
    observer = Observer()
    engine = RoundEngine(target, draft, SamplingTransform(0.0), stop_ids=[stop])
    result = engine.decode([GREEDY_PROMPT], make_policy("constant_k", 4), 12, [0], planner=observer)[0]
    assert result.tokens == greedy[:2]  # the request ended at its second token, the stop token
    assert observer.seen == [1, 2]  # candidates 3 and 4 lie past the end of the output


def test_the_oracle_decoded_by_the_engine_is_counted_as_evals_reading_of_constant_k_max():
    """Same seeds, same tokens: the oracle drafts to the cap as constant K_max does and counts only what it keeps,
    drafted candidates and draft forwards alike (one forward per kept candidate, what it would have spent)."""
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    prompt = type("Prompt", (), {"prompt_id": "p", "split": "test"})()
    discarded = 0
    for seed in range(5):
        oracle = engine.decode_one(PROMPT, make_policy("oracle", 3, max_draft=3), 6, seed=seed)
        constant = engine.decode_one(PROMPT, make_policy("constant_k", 3), 6, seed=seed)
        assert oracle.tokens == constant.tokens
        assert oracle.draft_forwards == oracle.drafted == oracle.accepted
        read = as_oracle(record_of(Setting("constant_k", 3.0), prompt, constant, 0.0))
        assert (oracle.drafted, oracle.accepted, oracle.draft_forwards, oracle.target_calls) == (
            read.drafted, read.accepted, read.draft_forwards, read.target_calls)
        discarded += constant.draft_forwards - constant.accepted
    assert discarded > 0  # the runs drafted candidates the oracle does not count
