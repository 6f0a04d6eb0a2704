"""`specheads train lookup from-logs`: labels and token inputs rebuilt from what a server recorded equal what ran, and a
head trained on the reached positions (the survival likelihood) is unbiased where one that reads unverified positions
as rejections is biased low and ranks worse: on planted positions, and end to end on a fixed-K rule's replayed log."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from test_vllm_proposer import Runner, copy_heavy, planted_head, vllm_config

from specheads.artifacts.metrics import expected_calibration_error, soft_auc
from specheads.dataset.datamodule import prompt_split
from specheads.integrations.vllm import LookupHeadProposer
from specheads.lookup.features import FEATURE_NAMES, token_features
from specheads.lookup.proposers import ngram_propose
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError
from specheads.train import lookup_logs
from specheads.train.lookup import LookupHeadModule
from specheads.train.lookup_bias import replayed_log
from specheads.train.lookup_logs import LogDataModule, decoder_log_lines, decoder_traces, log_tokens, observed_tokens


def served(tmp_path, max_reqs: int = 2, count: int = 6):
    """A run of the proposer with a head on vLLM's arrays: its log, the outputs' metrics as vLLM reports them, the
    runner, and the inputs the head read at each call (in order)."""
    prompts, responses = copy_heavy(3, count)
    log = tmp_path / "proposer.jsonl"
    proposer = LookupHeadProposer(vllm_config(5, 128, {"specheads": {"head": str(planted_head(tmp_path / "head")),
                                                                     "log": str(log), "token_cost": 0.2}}))
    read = []
    estimates = proposer.head.estimates
    proposer.head.estimates = lambda proposal: (read.append(token_features(proposal)), estimates(proposal))[1]
    runner = Runner(proposer, prompts, responses, max_reqs, 128)
    while runner.step(max_reqs):
        pass
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps({"event": "output", "prompt_token_ids": prompts[r],
                                           "output_token_ids": responses[r],
                                           "per_step_drafted": [d for d, _ in runner.steps.get(r, [])],
                                           "per_step_accepted": [a for _, a in runner.steps.get(r, [])]}) + "\n"
                               for r in range(len(prompts))))
    return log, outputs, runner, read


def test_labels_and_inputs_rebuilt_from_a_vllm_log_equal_what_ran(tmp_path):
    log, outputs, runner, read = served(tmp_path)
    records = lookup_logs.read_lines([str(log), str(outputs)])
    settings = next(r for r in records if r["event"] == "settings")
    traces = lookup_logs.vllm_traces(records)
    rebuilt = [lookup_logs.rebuild(trace, settings) for trace in traces]
    # the labels: 1 up to the accepted count of each verified draft, 0 at its first rejection, unobserved after
    for request, tokens in enumerate(rebuilt):
        truth = []
        for drafted, accepted in runner.steps.get(request, []):
            truth += [1.0] * accepted + ([0.0] if accepted < drafted else [])
        assert tokens["label"][~np.isnan(tokens["label"])].tolist() == truth
    # the inputs: what the head read, request by request, at every round vLLM verified (the calls with a proposal
    # before the output's end; a request's last call drafts what no step verifies)
    reads, by_request = iter(read), {r: [] for r in range(len(rebuilt))}
    for request, context, _ in runner.calls:
        if not ngram_propose(context, 5, len(runner.prompts[request])).tokens:
            continue
        features = next(reads)
        if len(context) - len(runner.prompts[request]) < len(runner.responses[request]):
            by_request[request].append(features)
    for request, tokens in enumerate(rebuilt):
        assert np.array_equal(np.concatenate(by_request[request]), tokens["features"])
    assert sum(len(t["features"]) for t in rebuilt) > 20


def test_a_log_that_does_not_match_vllms_counts_is_refused_in_one_line(tmp_path):
    log, outputs, runner, _ = served(tmp_path)
    lines = [json.loads(line) for line in outputs.read_text().splitlines()]
    request = next(i for i, line in enumerate(lines) if line["per_step_drafted"])
    lines[request]["per_step_drafted"][0] += 1
    outputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UsageError, match="vLLM verified drafts of") as refused:
        log_tokens([str(log), str(outputs)])
    assert "\n" not in str(refused.value)
    with pytest.raises(UsageError, match="is not a JSON line"):
        (tmp_path / "bad.jsonl").write_text("{\n")
        log_tokens([str(tmp_path / "bad.jsonl")])
    with pytest.raises(UsageError, match="not one of skip, reject"):
        LogDataModule([str(log)], unobserved="drop")


def test_decoder_round_log_labels_equal_the_rounds_it_recorded():
    prompts, responses = copy_heavy(4, 3)
    settings = {"k": 4, "max_ngram": 3, "min_ngram": 1, "draft": "lookup"}
    # a decoder's rounds at full K: each round verifies its proposal, accepts its agreement, emits one more
    records, truth = [], {r: [] for r in range(3)}
    made = {r: 0 for r in range(3)}
    while any(made[r] < len(responses[r]) for r in made):
        live = [r for r in made if made[r] < len(responses[r])]
        record = SimpleNamespace(requests=live, verified=[], emitted=[])
        for r in live:
            proposal = ngram_propose(prompts[r] + responses[r][: made[r]], 4, len(prompts[r]))
            rest = responses[r][made[r]:]
            accepted = next((i for i, (a, b) in enumerate(zip(proposal.tokens, rest)) if a != b),
                            min(len(proposal.tokens), len(rest)))
            emitted = min(accepted + 1, len(rest))
            ended = emitted == len(rest)  # the round that ends the request: its last token unobserved
            truth[r] += [1.0] * (emitted - 1) if ended else [1.0] * accepted + ([0.0] if accepted < len(proposal.tokens)
                                                                                else [])
            record.verified.append(len(proposal.tokens))
            record.emitted.append(emitted)
            made[r] += emitted
        records.append(record)
    lines = decoder_log_lines(settings, dict(enumerate(prompts)), dict(enumerate(responses)), records,
                              [None] * len(records))
    traces = decoder_traces(lines)
    for trace, request in zip(traces, range(3)):
        labels = lookup_logs.rebuild(trace, settings)["label"]
        assert labels[~np.isnan(labels)].tolist() == truth[request]


def planted(seed: int, rounds: int, rule: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Synthetic proposals of 6 tokens whose true conditional acceptance is known (it rises with the match length and
    falls with the position); `rule`: a running rule verifies 1 token where the distance is short and all 6 elsewhere
    (the distance says nothing of acceptance), else everything is verified. Returns every position (`label` NaN where
    unobserved) and the true â."""
    rng = np.random.default_rng(seed)
    k = np.tile(np.arange(1, 7), rounds)
    match = np.repeat(rng.integers(1, 4, rounds), 6)
    distance = np.repeat(rng.uniform(0, 5, rounds), 6)
    features = rng.normal(size=(rounds * 6, len(FEATURE_NAMES))).astype(np.float32) * 0.1
    features[:, 0], features[:, 1], features[:, 2], features[:, 4] = k, 6, match, distance
    truth = 1 / (1 + np.exp(-(1.6 * (match - 2) - 0.35 * (k - 1) + 0.8)))
    verified = np.where(distance < 2.5, 1, 6) if rule else np.full(rounds * 6, 6)
    labels = np.full(rounds * 6, np.nan)
    for r in range(rounds):
        for j in range(6):
            i = r * 6 + j
            if j >= verified[i]:
                break
            labels[i] = float(rng.random() < truth[i])
            if labels[i] == 0:
                break
    tokens = {"features": features, "label": labels, "position": k, "start": np.repeat(np.arange(rounds), 6),
              "row": np.repeat(np.arange(rounds) // 20, 6), "prompt_id": np.repeat(np.arange(rounds) // 20, 6).astype(str)}
    return tokens, truth


class Planted(LogDataModule):
    """The data module on planted positions (what `log_tokens` gives from real logs)."""

    def __init__(self, tokens: dict[str, np.ndarray], unobserved: str) -> None:
        super().__init__(["planted"], unobserved, val_fraction=0.2, batch_size=512)
        self.planted = tokens

    @property
    def manifest(self):
        return {"fingerprint": "planted", "identity": {"draft": {"kind": "lookup"}, "sampling": "greedy"}}

    def tokens(self):
        return observed_tokens(dict(self.planted), self.unobserved)


def fit(tokens, unobserved: str, tmp_path) -> TokenHead:
    return fit_on(Planted(tokens, unobserved), tmp_path / unobserved)


def fit_on(data: LogDataModule, folder) -> TokenHead:
    torch.manual_seed(0)
    module = LookupHeadModule(width=16, depth=1, lr=2e-2, export=str(folder))
    trainer = L.Trainer(max_epochs=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(folder.parent))
    trainer.fit(module, datamodule=data)
    return TokenHead.load(folder)


def test_unverified_positions_read_as_rejections_bias_the_head_low_and_the_survival_head_is_not(tmp_path):
    tokens, _ = planted(0, 2000, rule=True)
    held, truth = planted(1, 1000, rule=False)
    reached = ~np.isnan(held["label"])
    scores = {}
    for unobserved in ("skip", "reject"):
        head = fit(tokens, unobserved, tmp_path)
        predicted = head.probabilities(held["features"])
        cut = (held["features"][:, 4] < 2.5) & (held["position"] >= 2)  # where the running rule never verified
        scores[unobserved] = {"bias": float(np.mean(predicted[cut] - truth[cut])),
                              "auc": soft_auc(held["label"][reached], predicted[reached]),
                              "ece": expected_calibration_error(held["label"][reached], predicted[reached])}
    truth_auc = soft_auc(held["label"][reached], truth[reached])
    assert abs(scores["skip"]["bias"]) < 0.06, scores
    assert scores["reject"]["bias"] < -0.2, scores
    assert scores["skip"]["auc"] > truth_auc - 0.02 and scores["reject"]["auc"] < scores["skip"]["auc"] - 0.02, scores
    assert scores["reject"]["ece"] > scores["skip"]["ece"] + 0.05, scores
    assert math.isfinite(truth_auc)


def written_replay(path, seed: int, count: int, rule: str):
    """The round log of `rule` decoding copy-heavy greedy responses, its proposer reading 8 tokens a round."""
    prompts, responses = copy_heavy(seed, count)
    rows = [{"prompt_id": f"p{seed}-{i}", "prompt_ids": p, "target_ids": r}
            for i, (p, r) in enumerate(zip(prompts, responses))]
    path.write_text("".join(json.dumps(line) + "\n" for line in replayed_log(rows, rule, 8)))
    return str(path)


def test_a_fixed_k_log_read_with_rejections_misjudges_every_depth_past_k(tmp_path):
    # a running rule that verifies K = 2 of the 8 tokens its proposer reads: every position past 2 is unverified
    log = written_replay(tmp_path / "k2.jsonl", 5, 120, "constant_k:2")
    # held out: other prompts' full labels, every token a decode reaches (the log of a rule verifying all 8)
    records = lookup_logs.read_lines([written_replay(tmp_path / "k8.jsonl", 6, 60, "constant_k:8")])
    every = [lookup_logs.rebuild(trace, records[0]) for trace in decoder_traces(records)]
    full = {name: np.concatenate([tokens[name] for tokens in every]) for name in ("features", "label", "position")}
    full = {name: value[~np.isnan(full["label"])] for name, value in full.items()}
    deep = full["position"] > 2
    assert deep.sum() > 300 and 0.3 < full["label"][deep].mean() < 0.95
    scores = {}
    for unobserved in ("skip", "reject"):
        predicted = fit_on(LogDataModule([log], unobserved, val_fraction=0.2), tmp_path / unobserved).probabilities(
            full["features"])
        scores[unobserved] = {"bias": float(np.mean(predicted[deep] - full["label"][deep])),
                              "ece": expected_calibration_error(full["label"][deep], predicted[deep]),
                              "auc": soft_auc(full["label"], predicted)}
    assert scores["reject"]["bias"] < scores["skip"]["bias"] - 0.2 and scores["reject"]["bias"] < -0.3, scores
    assert scores["reject"]["ece"] > scores["skip"]["ece"] + 0.1, scores
    assert scores["reject"]["auc"] < scores["skip"]["auc"], scores
    assert log_tokens([log], "skip")[0]["position"].max() == 2  # no verified position past K


def test_a_replayed_log_splits_by_the_prompt_ids_it_carries(tmp_path):
    # the ids gen's labels are split by: a head from the log trains on the same prompts as one from the labels
    data = LogDataModule([written_replay(tmp_path / "k8.jsonl", 5, 30, "constant_k:8")], val_fraction=0.5)
    data.setup()
    for side in ("train", "val"):
        assert set(data.splits[side]["row"]) == {i for i in range(30) if prompt_split(f"p5-{i}", 0, 0.5) == side}


def test_from_logs_trains_and_exports_a_head_the_proposer_loads(tmp_path):
    log, outputs, _, _ = served(tmp_path, count=16)
    from specheads.train.cli import main

    code = main(["lookup", "from-logs", "fit", "--data.logs", json.dumps([str(log), str(outputs)]),
                 "--data.val_fraction", "0.4", "--trainer.max_epochs", "2", "--trainer.default_root_dir",
                 str(tmp_path / "run"), "--model.width", "8", "--model.depth", "0"])
    assert code == 0
    head = TokenHead.load(tmp_path / "run" / "head", draft_kind="lookup", target_state_size=0)
    assert head.config["training_data"]["draft"]["k"] == 5
