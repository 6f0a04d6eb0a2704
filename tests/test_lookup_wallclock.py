"""benchmarks/lookup_decode.py on the tiny target: every rule timed as it runs and paired prompt by prompt with the
target alone, resumable, refusals before any model loads."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import load_benchmark, random_token_head

from specheads.decoding.free_replay import SUFFIX_PLAN_DRAFT
from specheads.decoding.verify_curve import VERIFY_TOKENS
from specheads.lookup.proposers import suffix_available
from specheads.plumbing.errors import UsageError

TEXT = "def add(a, b): return a + b. def add(a, b): return a + b. def add(a, b):"
RULES = ["constant_k:3", "transformers:3", "lookup_table:0.043", "lookup_gate:0.043", "lookup_plan:0.043"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("lookup_decode")


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    return random_token_head(tmp_path_factory.mktemp("token-head"), "lookup")


@pytest.fixture(scope="module")
def family_prompts(tmp_path_factory):
    """Four prompts in two families, each repeating itself (prompt lookup finds matches)."""
    path = tmp_path_factory.mktemp("lookup-prompts") / "prompts.jsonl"
    rows = [{"id": f"q{i}", "category": ("copy", "chat")[i % 2], "prompt": TEXT * (1 + i % 2) + f" {i}"}
            for i in range(4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_every_rule_is_timed_and_paired_with_the_target_alone_and_resumes(bench, tiny_model, family_prompts,
                                                                          head_folder, tmp_path):
    out = tmp_path / "results.json"
    args = bench.LookupBenchmark(target=str(tiny_model), prompt_file=str(family_prompts), per_family=1,
                                 max_new_tokens=8, temperature=0.0, rules=RULES, head=str(head_folder),
                                 compare=["lookup_plan:0.043:constant_k:3"], resamples=50, out=str(out))
    args.check()
    results = bench.benchmark(args)
    runs = results["runs"]
    assert sorted(runs) == ["q0", "q1"]
    for run in runs.values():
        alone = run["alone"]
        for rule in RULES:
            record = run[rule]
            assert record["output"] == alone["output"], rule  # T = 0: every rule gives the target's greedy tokens
            assert 0 < record["target_seconds"] < record["seconds"], rule  # its target forwards inside its seconds
            assert record["target_calls"] >= 1
        assert run["constant_k:3"]["drafted"] > 0 and alone["target_calls"] == alone["tokens"]  # prefill + 1 a token
        assert 0 < run["lookup_plan:0.043"]["head_seconds"] < run["lookup_plan:0.043"]["seconds"]
        assert run["lookup_plan:0.043"]["head_calls"] > 0
    for rule in RULES:  # the summary's speedup is the geometric mean of the per-prompt paired rate ratios
        ratios = [(run[rule]["tokens"] / run[rule]["seconds"]) / (run["alone"]["tokens"] / run["alone"]["seconds"])
                  for run in runs.values()]
        row = results["summary"][rule]["all"]
        assert row["speedup"] == pytest.approx(math.exp(np.mean(np.log(ratios))))
        assert row["interval"][0] <= row["speedup"] <= row["interval"][1]
        assert row["same_as_target"] == 1.0
        assert set(results["summary"][rule]) >= {"copy", "chat"}
    pair = [run["lookup_plan:0.043"]["seconds"] / run["constant_k:3"]["seconds"] for run in runs.values()]
    assert results["paired"]["lookup_plan:0.043:constant_k:3"]["all"]["ratio"] == pytest.approx(
        1 / math.exp(np.mean(np.log(pair))))  # same tokens at T = 0: the rate ratio is the inverse time ratio
    counted = [(run["constant_k:3"]["tokens"] / (run["constant_k:3"]["target_calls"] + 0.043 * run["constant_k:3"][
        "drafted"])) / (run["alone"]["tokens"] / run["alone"]["target_calls"]) for run in runs.values()]
    assert results["summary"]["constant_k:3"]["all"]["counted_speedup"] == pytest.approx(math.exp(np.mean(np.log(counted))))
    assert results["summary"]["transformers:3"]["all"]["counted_speedup"] is None  # its drafted count is unknown
    curve = results["verify_curve"]  # measured once, the planners' price of a verify
    assert curve["tokens"] == list(VERIFY_TOKENS) and all(b >= a > 0 for a, b in zip(curve["seconds"], curve["seconds"][1:]))
    before = json.loads(out.read_text())
    again = bench.benchmark(args)
    assert again["runs"] == before["runs"]  # resumed: every (rule, prompt) finished, none run again
    assert again["verify_curve"] == before["verify_curve"]  # and planned with the curve it first read
    check_decode_only(bench, args, before)
    check_pool(bench, args, before, tmp_path)


def check_pool(bench, args, results, tmp_path):
    """--pool: two runs on other prompts summarised as one, prompt by prompt; a repeated prompt, other settings or a
    missing rule refused."""
    parts = []
    for pid in results["runs"]:
        part = tmp_path / f"part-{pid}.json"
        part.write_text(json.dumps({"settings": results["settings"], "runs": {pid: results["runs"][pid]}}))
        parts.append(str(part))
    pool = dataclasses.replace(args, report_only=True, pool=parts, out=str(tmp_path / "pooled.json"))
    pool.check()
    pooled = bench.benchmark(pool)
    for rule in RULES:
        assert pooled["summary"][rule]["all"]["speedup"] == pytest.approx(results["summary"][rule]["all"]["speedup"])
    for pair, row in results["paired"].items():
        assert pooled["paired"][pair]["all"]["ratio"] == pytest.approx(row["all"]["ratio"])
    assert json.loads((tmp_path / "pooled.json").read_text())["pooled_from"] == parts
    with pytest.raises(UsageError, match="new --out"):
        pool.check()  # pooled.json now exists
    for bad, match in (([parts[0], parts[0]], "repeats"), ([args.out], "lacks")):
        with pytest.raises(UsageError, match=match):
            bench.benchmark(dataclasses.replace(pool, pool=bad, rules=[*RULES, "constant_k:5"] if match == "lacks"
                                                else RULES, out=str(tmp_path / f"{match}.json")))
    other = json.loads(Path(parts[1]).read_text())
    other["settings"]["max_new_tokens"] += 1
    Path(parts[1]).write_text(json.dumps(other))
    with pytest.raises(UsageError, match="max-new-tokens"):
        bench.benchmark(dataclasses.replace(pool, out=str(tmp_path / "other.json")))


def check_decode_only(bench, args, results):
    """--decode-only: each side's rate over its seconds less its first forward's (the prefill, recorded on every run);
    refused on runs that lack it."""
    families = {pid: family for pid, family, _ in bench.chosen_prompts(args)}
    for run in results["runs"].values():
        for record in run.values():
            assert 0 < record["prefill_seconds"] < record["seconds"]
    only = bench.report(dataclasses.replace(args, decode_only=True), json.loads(json.dumps(results)), families)
    ratios = [(run["constant_k:3"]["tokens"] / (run["constant_k:3"]["seconds"] - run["constant_k:3"]["prefill_seconds"]))
              / (run["alone"]["tokens"] / (run["alone"]["seconds"] - run["alone"]["prefill_seconds"]))
              for run in results["runs"].values()]
    assert only["summary"]["constant_k:3"]["all"]["speedup"] == pytest.approx(math.exp(np.mean(np.log(ratios))))
    assert only["summary"]["constant_k:3"]["all"]["speedup"] != pytest.approx(
        results["summary"]["constant_k:3"]["all"]["speedup"], rel=1e-9)
    for run in results["runs"].values():
        del run["alone"]["prefill_seconds"]
    with pytest.raises(UsageError, match="prefill"):
        bench.report(dataclasses.replace(args, decode_only=True), results, families)


def test_refusals_before_any_model_loads(bench, family_prompts, head_folder, tmp_path):
    base = {"prompt_file": str(family_prompts), "out": str(tmp_path / "r.json")}
    for bad, message in ((dict(rules=["lookup_plan:0.043"]), "--head"),
                         (dict(rules=["transformers:2.5"]), "whole number"),
                         (dict(rules=["constant_k:3", "constant_k:3"]), "twice"),
                         (dict(rules=["constant_k:x"]), "name:threshold"),
                         (dict(compare=["constant_k:3:lookup_table:0.043"]), "--compare"),
                         (dict(temperature=math.nan), "--temperature")):
        with pytest.raises(UsageError, match=message):
            bench.LookupBenchmark(**{**base, **bad}).check()
    (tmp_path / "r.json").write_text(json.dumps({"settings": {"temperature": 1.0}, "runs": {}}))
    with pytest.raises(UsageError, match="another"):
        bench.load_results(bench.LookupBenchmark(**base))


def test_skip_per_family_takes_each_familys_next_prompts_and_refuses_a_negative_count(bench, family_prompts):
    args = bench.LookupBenchmark(prompt_file=str(family_prompts), per_family=1, skip_per_family=1)
    assert [(pid, family) for pid, family, _ in bench.chosen_prompts(args)] == [("q2", "copy"), ("q3", "chat")]
    assert [pid for pid, _, _ in bench.chosen_prompts(dataclasses.replace(args, skip_per_family=0))] == ["q0", "q1"]
    with pytest.raises(UsageError, match="skip-per-family"):
        dataclasses.replace(args, skip_per_family=-1).check()


@pytest.mark.skipif(not suffix_available(), reason="suffix drafts need arctic-inference (sh scripts/install.sh test)")
def test_suffix_rules_decode_in_engines_of_their_own_and_suffix_plan_reads_a_suffix_head(bench, tiny_model,
                                                                                          family_prompts, tmp_path):
    """suffix_plan: the planner fed a head trained on suffix drafts, its forwards timed; each suffix rule keeps its own
    global tree (one shared would hold the other rule's output of the prompt being decoded); refusals in one line."""
    suffix_head = random_token_head(tmp_path / "suffix-head", "suffix")
    rules = ["suffix_own:0.1", "suffix_plan:0.043", "suffix_table:0.043"]
    args = bench.LookupBenchmark(target=str(tiny_model), prompt_file=str(family_prompts), per_family=1,
                                 max_new_tokens=8, temperature=0.0, rules=rules, suffix_head=str(suffix_head),
                                 resamples=50, out=str(tmp_path / "results.json"))
    args.check()
    results = bench.benchmark(args)
    for run in results["runs"].values():
        assert all(run[rule]["output"] == run["alone"]["output"] for rule in rules)
        assert run["suffix_plan:0.043"]["head_calls"] > 0 and "head_calls" not in run["suffix_own:0.1"]
    runner = bench.Runner(args, bench.load_model(bench.ModelSpec(path=str(tiny_model))), set())
    assert runner.engine("suffix_own:0.1") is not runner.engine("suffix_plan:0.043")
    assert runner.engine("suffix_table:0.043").draft.max_spec_factor == SUFFIX_PLAN_DRAFT["max_spec_factor"]
    assert isinstance(runner.policies["suffix_table:0.043"], bench.AcceptanceTable)
    suffix, ngram, planners = runner.engine("suffix_own:0.1"), runner.engine("constant_k:3"), dict(runner.planners)
    assert suffix is runner.engine("suffix_own:0.1")
    runner.forget()  # after the warm-up: suffix trees and online planners start cold, prompt lookup's engine is kept
    assert runner.engine("suffix_own:0.1") is not suffix and runner.engine("constant_k:3") is ngram
    assert planners and all(runner.planners[rule] is not planner for rule, planner in planners.items())
    with pytest.raises(UsageError, match="--suffix-head"):
        dataclasses.replace(args, suffix_head=None).check()
    with pytest.raises(UsageError, match="draft"):  # a head trained on prompt lookup's drafts is refused
        bench.Runner(dataclasses.replace(args, suffix_head=str(random_token_head(tmp_path / "l", "lookup"))), None, set())
