"""The round engine over B rows against the same rows decoded alone: identical in float64, exactness, per-row cropping."""

import pytest
import torch
from test_eval import LENGTH, PROMPT, chi_square_p, sequence_probabilities, tiny_lm

from specheads.decoding import BatchCache, RoundEngine, make_policy
from specheads.decoding.prompt_cache import PromptCache
from specheads.decoding.rules import ONLINE_POLICIES
from specheads.heads import LinearVerifier, OnTimeAcceptanceHead, ResNetAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform

VOCAB = 24
STOPS = [5, 9, 13]
PROMPTS = [[1, 2, 3], [4, 7], [9, 3, 3, 8, 2, 11], [6], [2, 2, 2, 2], [12, 1, 0, 7, 7]]


@pytest.fixture(scope="module")
def pair64():
    """A tiny target/draft pair in float64 with a vocabulary large enough for varied rounds."""
    return tiny_lm(seed=11, vocab=VOCAB, init=0.5).double(), tiny_lm(seed=12, vocab=VOCAB, init=0.5).double()


def heads64():
    torch.manual_seed(3)
    lagged = ResNetAcceptanceHead(16, depth=1, extra_features=["logq", "entropy"],
                                  calibration={"scale": [0.9, 1.1], "bias": [0.1, -0.2]}).double().eval()
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).double().eval()
    for head in (lagged, on_time):
        torch.nn.init.normal_(head.out.weight, std=1.5)
    return {"lagged": lagged, "on_time": on_time}


SETTINGS = [("constant_k", 3, None), ("svip", 1.2, None), ("confidence", 0.3, None), ("oracle", 4, None),
            ("head", 0.5, "lagged"), ("head", 0.4, "on_time"), ("transformers", 0.4, None),
            ("transformers_heuristic", 5, None)]  # transformers' rules keep each request's state, as its generate


@pytest.mark.parametrize("stop_ids", [[], STOPS], ids=["no-stop-token", "stop-tokens"])
def test_every_row_of_a_batch_equals_the_row_decoded_alone_in_float64(pair64, stop_ids):
    target, draft = pair64
    heads = heads64()
    for temperature in (1.0, 0.0):
        decoder = RoundEngine(target, draft, SamplingTransform(temperature), stop_ids=stop_ids)
        seeds = [100 + i for i in range(len(PROMPTS))]
        for name, threshold, head_name in SETTINGS:
            policy = make_policy(name, threshold, max_draft=4)
            head = heads.get(head_name)
            batch = decoder.decode(PROMPTS, policy, 14, seeds, head)
            refilled = decoder.decode(PROMPTS, policy, 14, seeds, head, batch_size=4)  # continuous batching
            assert [r.tokens for r in refilled] == [r.tokens for r in batch], (name, head_name, temperature)
            assert [r.draft_forwards for r in refilled] == [r.draft_forwards for r in batch], (name, head_name)
            for prompt, seed, row in zip(PROMPTS, seeds, batch):
                single = decoder.decode_one(prompt, policy, 14, seed, head)
                assert row.tokens == single.tokens, (name, head_name, temperature)
                assert (row.emitted, row.drafted, row.accepted, row.target_calls, row.draft_forwards,
                        row.accepted_per_round) == (single.emitted, single.drafted, single.accepted,
                                                    single.target_calls, single.draft_forwards,
                                                    single.accepted_per_round), (name, head_name)
            if stop_ids and temperature == 1.0:  # rows end at different times, some on a stop token
                lengths = {len(row.tokens) for row in batch}
                assert len(lengths) > 1 and any(row.tokens and row.tokens[-1] in STOPS for row in batch), name


def test_decodes_that_start_from_the_prompt_cache_equal_decodes_that_prefill_in_float64(pair64):
    target, draft = pair64
    heads = heads64()
    plain = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=STOPS)
    cached = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=STOPS, prompt_cache=PromptCache(1 << 30))
    seeds = [40 + i for i in range(len(PROMPTS))]
    for name, threshold, head_name in SETTINGS[:6]:
        policy, head = make_policy(name, threshold, max_draft=4), heads.get(head_name)
        wanted = plain.decode(PROMPTS, policy, 10, seeds, head)
        for size in (None, 4, 1):  # the first decode fills the cache; refilled rows load it mid-batch
            got = cached.decode(PROMPTS, policy, 10, seeds, head, batch_size=size)
            assert [(r.tokens, r.draft_forwards, r.target_calls) for r in got] == \
                   [(r.tokens, r.draft_forwards, r.target_calls) for r in wanted], (name, size)
    prefixes = {tuple(prompt[:-1]) for prompt in PROMPTS if len(prompt) > 1}  # [6] has nothing before its last token
    assert {(name, p) for name, _, p in cached.prompt_cache.entries} == {(m, p) for m in ("draft", "target") for p in prefixes}
    assert cached.prompt_cache.hits == (6 * 3 - 1) * len(prefixes) * 2  # every decode but the first loads each prompt


def test_the_companion_loads_its_prompts_with_the_draft_or_not_at_all_and_a_warmed_cache_changes_nothing(pair64):
    """SV's companion is fed the draft's tokens in lockstep: a prompt stored for the draft by an earlier rule but not yet
    for the companion is prefilled by both, never loaded by one alone; `store_prompts` fills the cache up front."""
    import numpy as np

    from specheads.decoding.companion import BinTable, Companion

    target, draft = pair64
    companion = Companion(tiny_lm(seed=13, vocab=VOCAB, init=0.5).double(),
                          BinTable(np.array([0.5]), np.array([0.5]), np.array([[0.2, 0.6], [0.5, 0.9]])))
    seeds = [60 + i for i in range(len(PROMPTS))]
    rule = make_policy("sv_companion", 0.5, max_draft=4)
    plain = RoundEngine(target, draft, SamplingTransform(1.0), STOPS, companion).decode(PROMPTS, rule, 10, seeds)
    cached = RoundEngine(target, draft, SamplingTransform(1.0), STOPS, companion, PromptCache(1 << 30))
    cached.decode(PROMPTS, make_policy("constant_k", 2), 10, seeds)  # stores the draft's and the target's prompts only
    for _ in range(2):  # the companion's prompts are stored on the first pass and loaded on the second
        got = cached.decode(PROMPTS, rule, 10, seeds, batch_size=4)
        assert [(r.tokens, r.draft_forwards, r.companion_forwards) for r in got] == \
               [(r.tokens, r.draft_forwards, r.companion_forwards) for r in plain]
    warmed = RoundEngine(target, draft, SamplingTransform(1.0), STOPS, companion, PromptCache(1 << 30))
    warmed.store_prompts(PROMPTS, batch_size=4)
    assert len(warmed.prompt_cache.entries) == 3 * 5 and warmed.prompt_cache.hits == 0  # 5 prompts of 2+ tokens
    got = warmed.decode(PROMPTS, rule, 10, seeds)
    assert [r.tokens for r in got] == [r.tokens for r in plain] and warmed.prompt_cache.hits == 3 * 5


def test_the_prompt_cache_keeps_to_its_bound_and_keys_entries_by_model():
    keys = torch.zeros(1, 4, 2)  # 32 bytes a tensor, 64 an entry
    store = PromptCache(max_bytes=150)
    model, other = object(), object()
    for prefix in ((1,), (2,), (3,)):
        store.put("draft", model, prefix, [(keys, keys)])
    assert [p for _, _, p in store.entries] == [(1,), (2,)] and store.bytes == 128  # full: (3,) was not stored
    assert not store.put("draft", model, (4,), [(keys, keys)]) and store.put("draft", model, (1,), [(keys, keys)])
    assert store.get("draft", model, (2,)) is not None and store.get("target", model, (2,)) is None
    assert store.get("draft", other, (2,)) is None  # another model under the same name never gets these keys
    assert store.hits == 1 and store.holds("draft", model, (1,)) and store.hits == 1


def test_sprinter_rows_of_a_batch_equal_the_rows_decoded_alone_in_float64(pair64):
    target, draft = pair64
    decoder = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=STOPS)
    torch.manual_seed(5)
    verifier = LinearVerifier(16, extra_features=["logq"], candidate_embedding_size=16).double().eval()
    torch.nn.init.normal_(verifier.out.weight, std=1.0)
    seeds = [7 * i for i in range(len(PROMPTS))]
    for threshold in (0.3, 0.6):
        rule = make_policy("sprinter", threshold)
        batch = decoder.decode(PROMPTS, rule, 12, seeds, verifier)
        calls = 0
        for prompt, seed, row in zip(PROMPTS, seeds, batch):
            single = decoder.decode_one(prompt, rule, 12, seed, verifier)
            assert (row.tokens, row.drafted, row.accepted, row.target_calls, row.accepted_per_round) == (
                single.tokens, single.drafted, single.accepted, single.target_calls, single.accepted_per_round)
            calls += row.target_calls
        assert 0 < calls < sum(row.drafted for row in batch)  # some tokens passed unverified, some were verified


def test_per_row_cropping_gives_the_logits_of_a_fresh_forward(pair64):
    target, _ = pair64
    cache = BatchCache(target, 3)
    cache.feed({0: [1, 2, 3, 4], 1: [5, 6], 2: [7, 8, 9]})
    cache.feed({0: [10, 11], 2: [12]})
    cache.crop_row(0, 3)  # drops 4, 10, 11
    cache.crop_row(2, 4)  # keeps 7, 8, 9, 12
    cache.trim()
    outputs = cache.feed({0: [13], 1: [14, 15], 2: [16]}, {1: 2})
    for row, tokens in ((0, [1, 2, 3, 13]), (1, [5, 6, 14, 15]), (2, [7, 8, 9, 12, 16])):
        fresh = target(torch.tensor([tokens])).logits[0].float()
        wanted = 2 if row == 1 else 1
        assert torch.allclose(outputs[row][0], fresh[-wanted:], atol=1e-10), row
    assert cache.lengths == [4, 4, 5]


def test_the_batched_loop_samples_the_target_distribution():
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    transform = SamplingTransform(1.0)
    exact = sequence_probabilities(target, transform)
    decoder = RoundEngine(target, draft, transform, stop_ids=[])
    on_time = OnTimeAcceptanceHead(16, depth=1, extra_features=["logq", "q"], candidate_embedding_size=16).eval()
    torch.nn.init.normal_(on_time.out.weight, std=2.0)
    runs, batch = 500, 50
    for name, threshold, head in (("constant_k", 2, None), ("confidence", 0.4, None), ("head", 0.5, on_time)):
        policy = make_policy(name, threshold, max_draft=3)
        samples = [tuple(result.tokens) for start in range(0, runs, batch)
                   for result in decoder.decode([PROMPT] * batch, policy, LENGTH, list(range(start, start + batch)), head)]
        assert chi_square_p(samples, exact) > 1e-3, name


# ---- serving batch sizes


def test_serving_accounting_on_a_hand_computed_case():
    from specheads.eval.serving import CostCurve, serve

    draft = CostCurve((1, 2), (2.0, 3.0))  # 1 + n seconds for n tokens, extrapolated linearly
    target = CostCurve((1, 2), (11.0, 12.0))  # 10 + n
    requests = [[(2, 2, [1, 1]), (1, 2, [1])], [(3, 1, [1, 1, 1])]]  # rounds of (candidates, tokens yielded =
    # accepted + 1, the tokens of each draft forward: a chain's one a step)
    # B = 1: (2 + 2 + 13) + (2 + 12) + (2 + 2 + 2 + 14) = 51 s for 2 + 2 + 1 tokens
    alone = serve(requests, 1, draft, target)
    assert (alone["seconds"], alone["tokens"]) == (51.0, 5.0)
    # B = 2: round 1 drafts with 2, 2, 1 rows (3 + 3 + 2) and verifies 3 + 4 tokens (17); round 2 as alone (2 + 12)
    together = serve(requests, 2, draft, target)
    assert (together["seconds"], together["tokens"], together["batched_rounds"]) == (39.0, 5.0, 2)
    assert target(30) == 40.0 and draft(0) == 0.0
    # a tree round: 4 nodes, drafted in two forwards (the tail's, then 3 nodes read together), beside a chain of 2:
    # the draft's forwards read 1 + 1 and 3 + 1 tokens (3 + 5), the target checks 5 + 3 tokens (18)
    tree = serve([[(4, 3, [1, 3])], [(2, 1, [1, 1])]], 2, draft, target)
    assert (tree["seconds"], tree["tokens"]) == (26.0, 4.0)


def test_eval_serving_report_and_batched_sweep_agree_with_batch_1(trained, tmp_path):
    import json

    from specheads.cli import main

    data, root = trained
    checkpoint = root / "specdecpp" / "checkpoints" / "last.ckpt"
    common = ["eval", "--head", str(checkpoint), "--data", str(data), "--num-decode-prompts", "6", "--max-new-tokens", "6",
              "--max-draft", "3", "--constant-ks", "[1,3]", "--head-thresholds", "[0.5]", "--stop-shares", "[0.5]",
              "--bootstrap", "5", "--progress", "false", "--test-samples", "3"]  # 3 requests fill B = 3
    assert main([*common, "--out", str(tmp_path / "batched"), "--decode-batch-size", "4",
                 "--serving-batch-sizes", "[1, 3]"]) == 0
    assert main([*common, "--out", str(tmp_path / "single"), "--decode-batch-size", "1"]) == 0
    key = ("policy", "threshold", "prompt_id", "emitted", "drafted", "accepted", "target_calls", "accepted_per_round")
    runs = {name: [tuple(str(r[k]) for k in key) for r in json.loads((tmp_path / name / "runs.json").read_text())["runs"]
                   if r["policy"] not in ONLINE_POLICIES]  # those learn from the runs before them, in batch order
            for name in ("batched", "single")}
    same = sum(a == b for a, b in zip(runs["batched"], runs["single"]))
    assert len(runs["batched"]) == len(runs["single"]) and same >= 0.9 * len(runs["single"])
    serving = json.loads((tmp_path / "batched" / "metrics.json").read_text())["decoding"]["serving"]
    assert {row["batch_size"] for row in serving["rows"]} == {1, 3}
    assert set(serving["best"]) == {"measured", "draft at 0.2 × target"}
    assert all(set(best) == {"1", "3"} for best in serving["best"].values())
    # SmartSpec decoded live at every B and view; the budget needs an expected-acceptance head, and says so
    assert {(r["batch_size"], r["costs"]) for r in serving["rows"] if r["policy"] == "smartspec" and r["decoded"] == "live"} \
        == {(b, v) for b in (1, 3) for v in serving["best"]}
    assert "--budget-head" in serving["left_out"]["budget"] and "--budget-head" in serving["left_out"]["goodput"]
    for policy in ("dcut", "vllm_adaptive"):  # the goodput planner on free signals is decoded live beside SmartSpec
        assert {(r["batch_size"], r["costs"]) for r in serving["rows"] if r["policy"] == policy and r["decoded"] == "live"} \
            == {(b, v) for b in (1, 3) for v in serving["best"]}
    assert serving["cost_curves"]["measured"]["source"] == "measured on the CPU"
    assert all(row["tokens_per_s"] > 0 for row in serving["rows"])
    assert (tmp_path / "batched" / "serving.png").stat().st_size > 1000
    assert "At serving batch sizes" in (tmp_path / "batched" / "report.md").read_text()
