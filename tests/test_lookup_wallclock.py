"""benchmarks/lookup_decode.py on the tiny target: every rule timed as it runs and paired prompt by prompt with the
target alone, resumable, refusals before any model loads."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_benchmark
from safetensors.torch import save_file

from specheads.decoding.verify_curve import VERIFY_TOKENS
from specheads.lookup.features import FEATURE_NAMES
from specheads.lookup.token_head import CONFIG, FORMAT, STOP, WEIGHTS, expected_shapes
from specheads.plumbing.errors import UsageError

TEXT = "def add(a, b): return a + b. def add(a, b): return a + b. def add(a, b):"
RULES = ["constant_k:3", "transformers:3", "lookup_table:0.043", "lookup_gate:0.043", "lookup_plan:0.043"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("lookup_decode")


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    """A token-only stop head with random weights, exported as `specheads train lookup fit` exports one."""
    config = {"format": FORMAT, "head_type": STOP, "purpose": "stop", "inputs": list(FEATURE_NAMES), "width": 8,
              "depth": 1, "target_state_size": 0, "draft_kind": "lookup"}
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in expected_shapes(config).items()}
    tensors["feature_mean"].zero_()
    tensors["feature_std"].fill_(1.0)
    folder = tmp_path_factory.mktemp("token-head")
    (folder / CONFIG).write_text(json.dumps(config))
    save_file(tensors, str(folder / WEIGHTS))
    return folder


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
