"""benchmarks/transfer.py (issues 53, 62): every free rule tuned per prompt family, and each rule tuned nowhere (the
head's rule read from the costs, as trained and calibrated online) judged against the free rules tuned on another
family. Records are written by hand here; nothing is decoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def transfer():
    return load_benchmark("transfer")


def write_prompts(path: Path, per_family: int) -> list[dict]:
    rows = [{"id": f"{family}-{i}", "category": family, "prompt": f"{family} prompt {i}"}
            for family in ("chat", "code") for i in range(per_family)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def write_setting(folder: Path, policy: str, threshold: float, rows: list[dict], calls, **extra) -> None:
    """A setting's records: 8 tokens a prompt for 4 draft forwards and `calls(row)` target calls."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"prompt": row["id"], "family": row["category"], "emitted": 8, "accepted": 4, "drafted": 4,
                "draft_forwards": 4, "head_forwards": 0.0, "target_calls": calls(row)} for row in rows]
    (folder / f"{policy}-{threshold:g}.json").write_text(json.dumps({"policy": policy, "threshold": threshold,
                                                                     "records": records, **extra}))


def test_the_new_free_rules_are_tuned_per_family_and_the_online_head_rule_is_judged_against_them(transfer, tmp_path):
    """vLLM's merged estimator, its margin revision and llama.cpp's p_min join the tuned grid; head_cost_online is
    decoded at each c beside head_cost and gets its own table: on a family where it needs fewer target calls than every
    free rule tuned on the other family, its gain over the strongest of them is positive; a setting whose estimate
    never refitted is named."""
    dev, test = write_prompts(tmp_path / "dev.jsonl", 2), write_prompts(tmp_path / "test.jsonl", 3)
    config = transfer.Config(out=str(tmp_path / "out"), dev_file=str(tmp_path / "dev.jsonl"),
                             test_file=str(tmp_path / "test.jsonl"), cost_ratios=[0.2], constant_ks=[2],
                             confidence=[0.3], adaedl=[0.5], sglang_adaptive=[3], vllm_online=[0.5],
                             vllm_current=[0.3, 0.6], vllm_margin=[0.5], pmin=[0.5, 0.8], head_thresholds=[0.6],
                             transformers_default=False, resamples=50)
    settings = transfer.grid(config)
    assert {("vllm_current", 0.3), ("vllm_current", 0.6), ("vllm_margin", 0.5), ("pmin", 0.8),
            ("head_cost", 0.2), ("head_cost_online", 0.2)} <= set(settings)
    for policy, threshold in settings:
        if policy not in transfer.TUNED_NOWHERE:  # the higher threshold wins on chat, the lower on code
            better = max(t for p, t in settings if p == policy)
            write_setting(Path(config.out) / "tune", policy, threshold, dev,
                          lambda row, t=threshold, b=better: 4 - ((t == b) == (row["category"] == "chat")))
    chosen = transfer.settings(config, "confirm")
    assert {("head_cost", 0.2), ("head_cost_online", 0.2), ("pmin", 0.5), ("pmin", 0.8)} <= set(chosen)
    calls = {"head_cost_online": lambda row: 2, "head_cost": lambda row: 5}
    for policy, threshold in chosen:
        refits = {"refits": 0 if policy == "head_cost_online" else 2} if policy.startswith(("vllm_c", "head_cost_")) else {}
        write_setting(Path(config.out) / "confirm", policy, threshold, test,
                      calls.get(policy, lambda row: 3 + (row["id"][-1] == "0")), **refits)
    transfer.report(config)
    results = json.loads((Path(config.out) / "results-confirm.json").read_text())
    rows = {(row["rule"], row["family"]): row for row in results["rows"]}
    assert set(rows) == {(rule, family) for rule in transfer.TUNED_NOWHERE for family in ("chat", "code")}
    online = rows["head_cost_online", "chat"]
    assert set(online["rules"]) == {*transfer.FREE_RULES, "head"}
    margin = online["rules"]["vllm_margin"]
    assert margin["strongest_other_source"] == "code" and margin["gain_over_strongest_other"][1] > 0
    assert rows["head_cost", "chat"]["rules"]["pmin"]["gain_over_strongest_other"][0] < 0
    assert {row["rule"] for row in results["pooled"]} == set(transfer.TUNED_NOWHERE)
    assert results["unrefitted"] == ["head_cost_online-0.2"]  # it ran on the head's own calibration throughout
