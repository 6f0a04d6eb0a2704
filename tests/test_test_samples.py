"""Several samples of each test prompt (`eval --test-samples`): a serving queue long enough to fill large B, with the
paired intervals resampling prompts, not samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.eval.config import EvalConfig
from specheads.eval.serving import LiveRun, paired_ratio_interval, replay, request_rounds, serving_table
from specheads.eval.sweep import RunRecord, Setting, paired_gain_interval, prompt_group, sample_prompt_id
from specheads.plumbing.errors import UsageError


def run(policy: str, prompt_id: str, calls: int, accepted: int = 2) -> RunRecord:
    return RunRecord(policy, 1.0, prompt_id, "test", emitted=2 * (accepted + 1), drafted=4, accepted=2 * accepted,
                     target_calls=calls, draft_forwards=4, seconds=1.0, forward_seconds=1.0,
                     accepted_per_round=[accepted] * 2, target_logprob=-1.0, drafted_per_round=[2] * 2)


def test_sample_ids_name_their_prompt():
    assert sample_prompt_id("chat-7", 3) == "chat-7#sample3"
    assert prompt_group("chat-7#sample3") == prompt_group("chat-7") == "chat-7"
    assert prompt_group("a#sample2b") == "a#sample2b"  # only a trailing sample number marks a sample


def test_the_paired_interval_resamples_a_prompt_with_all_its_samples():
    """Two samples of each of 6 prompts give the interval of the 6 prompts with each prompt's samples merged, not
    that of 12 independent prompts; one prompt with two samples gives none."""
    rng = np.random.default_rng(0)
    calls = {(policy, p, s): int(rng.integers(3, 12)) for policy in ("head", "constant_k") for p in range(6)
             for s in range(2)}
    sampled = [run(policy, sample_prompt_id(f"p{p}", s) if s else f"p{p}", calls[policy, p, s])
               for policy, p, s in calls]
    merged = [RunRecord(policy, 1.0, f"p{p}", "test", emitted=12, drafted=8, accepted=8,
                        target_calls=calls[policy, p, 0] + calls[policy, p, 1], draft_forwards=8, seconds=2.0,
                        forward_seconds=2.0, accepted_per_round=[2] * 4, target_logprob=-1.0)
              for policy in ("head", "constant_k") for p in range(6)]
    head, constant = Setting("head", 1.0), Setting("constant_k", 1.0)
    grouped = paired_gain_interval(sampled, head, constant, 0.2, resamples=300, seed=3)
    assert grouped == pytest.approx(paired_gain_interval(merged, head, constant, 0.2, resamples=300, seed=3))
    one_prompt = [r for r in sampled if prompt_group(r.prompt_id) == "p0"]
    assert paired_gain_interval(one_prompt, head, constant, 0.2) is None


def test_the_serving_table_serves_every_sample_and_pairs_by_prompt():
    """A queue of 2 samples × 3 prompts fills B = 6; each row counts 6 requests, and a policy that is better on one
    prompt's samples only has an interval drawn over 3 prompts (it touches zero when that prompt is left out). The
    runs are served in the queue's order whatever their order in the records, and a live row's requests (numbered in
    queue order) are grouped by prompt the same way."""
    queue = ["a", "b", "c", "a#sample1", "b#sample1", "c#sample1"]
    records = [run("constant_k", prompt, 2, accepted=0 if prompt_group(prompt) == "a" else 2) for prompt in reversed(queue)]
    records += [run("oracle", prompt, 2) for prompt in queue]
    flat = CostCurve((1, 512), (1.0, 1.0))

    def live(policy, threshold, size, costs):  # the oracle's rounds, decoded "live" in queue order
        return LiveRun(replay([request_rounds(r) for r in records[6:]], size))

    rows = serving_table(records, {"constant_k": 1.0, "oracle": 1.0}, [6], {"flat": lambda size: ServingCosts(flat, flat)},
                         live=live, batch_policies={"budget": 1.0}, resamples=400, seed=0, queue=queue)
    by_policy = {row["policy"]: row for row in rows}
    assert by_policy["constant_k"]["requests"] == by_policy["oracle"]["requests"] == 6
    low, high = by_policy["oracle"]["vs_constant_k_ci"]
    assert low == pytest.approx(0.0) and high > 0.0
    per_prompt = {"oracle": {p: [12.0, 2.0] for p in "abc"},  # 2 rounds of 3 tokens a sample, 3 s a round over 6 rows
                  "constant_k": {"a": [4.0, 2.0], "b": [12.0, 2.0], "c": [12.0, 2.0]}}
    assert [low, high] == paired_ratio_interval(per_prompt["oracle"], per_prompt["constant_k"], 400, 0)
    assert by_policy["budget"]["vs_constant_k_ci"] == [low, high]  # the live row pairs with the same prompts


def test_test_samples_follow_every_prompt_so_sample_zero_keeps_its_seed(tmp_path, monkeypatch):
    from specheads.eval import run as eval_run

    monkeypatch.setattr(eval_run, "encode_prompt", lambda tokenizer, prompt: [len(prompt.messages[0][1])] * 3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "x" * (i + 1)}) + "\n" for i in range(4)))
    config = EvalConfig(head="h", data="d", decode_prompts=str(prompts), num_decode_prompts=4, test_samples=3)
    chosen, _ = eval_run.held_out_prompts(config, {}, set(), None, 10_000)
    assert [(p.prompt_id, p.split) for p in chosen[:4]] == [("q0", "dev"), ("q1", "test"), ("q2", "dev"), ("q3", "test")]
    assert [p.prompt_id for p in chosen[4:]] == ["q1#sample1", "q3#sample1", "q1#sample2", "q3#sample2"]
    assert all(p.split == "test" and p.ids == chosen[1 + 2 * (i % 2)].ids for i, p in enumerate(chosen[4:]))
    prompts.write_text(json.dumps({"id": "q0#sample2", "prompt": "x"}) + "\n")
    with pytest.raises(UsageError, match="ends like the id of a prompt's further sample"):
        eval_run.held_out_prompts(config, {}, set(), None, 10_000)


def test_a_prompts_samples_count_as_one_prompt_in_the_decoding_figures():
    from specheads.eval.sweep import aggregate

    records = [run("constant_k", prompt, 2) for prompt in ("a", "b", "a#sample1", "b#sample1")]
    (row,) = aggregate(records, "test", 0.2, 0.2)
    assert (row["prompts"], row["runs"]) == (2, 4)
