"""`specheads train lookup from-logs fit`: a token-only head of prompt-lookup drafts trained from what a server
recorded, with no target forward and no gen run (docs/method.md, "Learning from logs").

What it reads (JSON lines, any number of files, told apart by their `event`):
- vLLM with `specheads.integrations.vllm.LookupHeadProposer` and a log: the proposer's own `settings`, `start`
  (a request's prompt) and `round` records (output tokens before the round, tokens proposed, tokens verified), and
  per request an `output` record that the serving script writes from vLLM's `RequestOutput`: `prompt_token_ids`,
  `output_token_ids` and `--per-request-spec-decode-metrics detailed`'s `per_step_drafted` / `per_step_accepted`,
  which hold only the steps that carried a draft; the proposer's rounds place them (the verified rounds, in order);
- our decoder's round log: a `decoder_settings` record, and per request a `decoder_request` record (prompt and
  output token ids) and its `decoder_round` records in order (a `RoundRecord` row: `verified`, `emitted`)
  (`decoder_log_lines`).

Every round's proposal is read again from its verified context (`ngram_propose`: the proposal is a function of it), its
token inputs rebuilt from it (`token_features`, functions of the verified context: they equal what the running head
read), and each proposed position labelled: verified and accepted 1, verified and rejected 0,
never verified (cut by the running rule's stop, or after a rejection) unobserved. The head trains on the reached
positions only, so its loss is the survival likelihood: Π â over the accepted prefix times (1 − â) at the first
rejection; an unreached position contributes nothing (`unobserved: skip`). `unobserved: reject` labels them 0
instead, which biases the head low wherever the running rule stopped early: it is here to measure that bias.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specheads.dataset.datamodule import prompt_split
from specheads.lookup.features import FEATURE_NAMES, token_features
from specheads.lookup.proposers import ngram_propose
from specheads.plumbing.errors import UsageError
from specheads.train.lookup import LookupDataModule

UNOBSERVED = ("skip", "reject")


@dataclass
class Trace:
    """One request as a server ran it: prompt, output, and its rounds in order as (output tokens before the round,
    tokens proposed, tokens verified, tokens accepted)."""

    name: str
    prompt: list[int]
    output: list[int]
    rounds: list[tuple[int, int | None, int, int]] = field(default_factory=list)  # proposed None: all it read
    prompt_id: str | None = None  # the id a log gave the request's prompt (None: a digest of its tokens)


def read_lines(paths: list[str]) -> list[dict[str, Any]]:
    """Every JSON record of `paths`, refused in one line naming a file that is missing or a line that is not JSON."""
    records = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"log {path} does not exist; give the JSONL files the server wrote")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise UsageError(f"{path}:{number} is not a JSON line; give the logs as the server wrote them") from None
    return records


def draft_settings(records: list[dict[str, Any]], event: str) -> dict[str, Any]:
    """The one draft setting of the logs' `event` records (k, max_ngram, min_ngram, draft), refused if none or mixed."""
    found = {json.dumps({key: r.get(key) for key in ("k", "max_ngram", "min_ngram", "draft")}, sort_keys=True)
             for r in records if r.get("event") == event}
    if len(found) != 1:
        raise UsageError(f"the logs hold {len(found)} draft settings ({event} records); give logs of one draft setting")
    settings = json.loads(found.pop())
    if settings.get("draft", "lookup") != "lookup":
        raise UsageError(f"from-logs rebuilds prompt-lookup drafts, not {settings['draft']!r} (a suffix tree depends "
                         "on every earlier request); log a prompt-lookup proposer")
    return settings


def vllm_traces(records: list[dict[str, Any]]) -> list[Trace]:
    """The requests of a vLLM log: each `output` record joined to the proposer's request of the same prompt (in order)
    and its vLLM per-step counts placed on the proposer's verified rounds (module docstring)."""
    started: dict[tuple[str, int], list[int]] = {}
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        key = (record.get("session", ""), record.get("request"))
        if record.get("event") == "start":
            started[key] = record["prompt_token_ids"]
        elif record.get("event") == "round":
            rounds[key].append(record)
    by_prompt: dict[tuple[int, ...], list[tuple[str, int]]] = defaultdict(list)
    for key, prompt in started.items():
        by_prompt[tuple(prompt)].append(key)
    traces = []
    for number, record in enumerate(r for r in records if r.get("event") == "output"):
        candidates = by_prompt.get(tuple(record["prompt_token_ids"]))
        if not candidates:
            raise UsageError(f"output record {number} has no proposer request of its prompt; give the proposer's log of "
                             "the same run")
        traces.append(paired(f"output {number}", record, candidates, rounds))
    return traces


def paired(name: str, record: dict[str, Any], candidates: list[tuple[str, int]],
           rounds: dict[tuple[str, int], list[dict[str, Any]]]) -> Trace:
    """The trace of the first proposer request of the output's prompt whose verified rounds are vLLM's (`placed`),
    taken from `candidates` (a warm-up or a repeated prompt has a request of the same prompt); refused if none."""
    problem = None
    for index, key in enumerate(candidates):
        try:
            trace = placed(name, record, rounds[key])
        except UsageError as error:
            problem = problem or error
            continue
        del candidates[index]
        return trace
    raise problem


def placed(name: str, record: dict[str, Any], rounds: list[dict[str, Any]]) -> Trace:
    """The request's trace: the proposer's rounds that vLLM verified (start before the output's end), the accepted
    counts from vLLM's per-step lists on the rounds that verified a draft; refused where they disagree."""
    output = list(record["output_token_ids"])
    ran = [r for r in rounds if r["start"] < len(output)]
    drafted = [r["verified"] for r in ran if r["verified"]]
    if drafted != list(record["per_step_drafted"]) or len(record["per_step_accepted"]) != len(drafted):
        raise UsageError(f"{name}: vLLM verified drafts of {list(record['per_step_drafted'])} tokens where the proposer "
                         f"drafted {drafted}; give the proposer's log and vLLM's metrics of the same run")
    accepted = iter(record["per_step_accepted"])
    trace = Trace(name, list(record["prompt_token_ids"]), output)
    for r in ran:
        trace.rounds.append((r["start"], r["proposed"], r["verified"], int(next(accepted)) if r["verified"] else 0))
    return trace


def decoder_traces(records: list[dict[str, Any]]) -> list[Trace]:
    """The requests of our decoder's round log (`decoder_log_lines`): a round accepted all but the last token it
    emitted; in the round that ended a request that last token is unobserved (an accepted token the request's end cut
    and a resampled one read alike in the log)."""
    traces: dict[int, Trace] = {}
    for record in records:
        if record.get("event") == "decoder_request":
            traces[record["request"]] = Trace(f"request {record['request']}", record["prompt_token_ids"],
                                              record["output_token_ids"], prompt_id=record.get("prompt_id"))
    made: dict[int, int] = defaultdict(int)
    for record in records:
        if record.get("event") != "decoder_round":
            continue
        proposed_rows = record.get("proposed") or [None] * len(record["requests"])
        for request, verified, emitted, proposed in zip(record["requests"], record["verified"], record["emitted"],
                                                        proposed_rows, strict=True):
            trace = traces[request]
            accepted = max(min(verified, emitted - 1), 0)
            if made[request] + emitted >= len(trace.output):  # its last token may be accepted and cut, or resampled
                verified = accepted
            trace.rounds.append((made[request], proposed, verified, accepted))
            made[request] += emitted
    return list(traces.values())


def decoder_log_lines(settings: dict[str, Any], prompts: dict[int, list[int]], outputs: dict[int, list[int]],
                      records: list[Any], proposed: list[list[int] | None],
                      prompt_ids: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """Our decoder's round log as JSON records: its draft settings, each request's prompt and output (and its
    prompt's id where `prompt_ids` names one: the split by prompt then reads it, as gen's labels are split), and each
    `RoundRecord` with the tokens each row's proposal held (`proposed`, row for row; None: as many as the proposal
    read again holds, the draft's K)."""
    lines = [{"event": "decoder_settings", **settings}]
    lines += [{"event": "decoder_request", "request": r, "prompt_token_ids": prompts[r], "output_token_ids": outputs[r],
               **({"prompt_id": prompt_ids[r]} if prompt_ids and r in prompt_ids else {})} for r in prompts]
    lines += [{"event": "decoder_round", "requests": list(record.requests), "verified": list(record.verified),
               "emitted": list(record.emitted), "proposed": rows} for record, rows in zip(records, proposed)]
    return lines


def rebuild(trace: Trace, settings: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every proposed position of the trace's rounds: `features` [n, F], `label` (1, 0, NaN unobserved), `position`,
    `start` (module docstring); refused where a proposal read again differs from the log."""
    parts = defaultdict(list)
    for start, proposed, verified, accepted in trace.rounds:
        context = trace.prompt + trace.output[:start]
        proposal = ngram_propose(context, int(settings["k"]), len(trace.prompt), int(settings["max_ngram"]),
                                 int(settings["min_ngram"]))
        proposed = len(proposal.tokens) if proposed is None else proposed
        shown = trace.output[start: start + accepted]  # vLLM counts accepted tokens its max_tokens then cut
        if len(proposal.tokens) < proposed or list(proposal.tokens[: len(shown)]) != shown:
            raise UsageError(f"{trace.name}: the proposal read again at output token {start} is not the one the log "
                             "verified; give the logs with the draft settings they were made with")
        if proposed:
            cut = type(proposal)(**{**proposal.__dict__, "tokens": proposal.tokens[:proposed],
                                    "scores": proposal.scores[:proposed]})
            labels = np.full(proposed, np.nan)
            labels[:accepted] = 1.0
            if accepted < verified:
                labels[accepted] = 0.0
            parts["features"].append(token_features(cut))
            parts["label"].append(labels)
            parts["position"].append(np.arange(1, proposed + 1))
            parts["start"].append(np.full(proposed, start))
    if not parts:
        return {"features": np.empty((0, len(FEATURE_NAMES)), np.float32), "label": np.empty(0),
                "position": np.empty(0, np.int64), "start": np.empty(0, np.int64)}
    return {name: np.concatenate(values) for name, values in parts.items()}


def log_tokens(paths: list[str], unobserved: str = "skip") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The labelled positions of the logs (flat: `features`, `label`, `reach`, `survival`, `position`, `start`,
    `row`, `prompt_id`) and their draft settings; `unobserved`: skip the unreached positions (the survival
    likelihood) or label them 0 (`reject`, the biased view)."""
    records = read_lines(paths)
    if any(r.get("event") == "decoder_settings" for r in records):
        settings, traces = draft_settings(records, "decoder_settings"), decoder_traces(records)
    else:
        settings, traces = draft_settings(records, "settings"), vllm_traces(records)
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    for index, trace in enumerate(traces):
        tokens = rebuild(trace, settings)
        parts["row"].append(np.full(len(tokens["label"]), index))
        prompt_id = trace.prompt_id or hashlib.sha256(json.dumps(trace.prompt).encode()).hexdigest()[:16]
        parts["prompt_id"].append(np.full(len(tokens["label"]), prompt_id))
        for name, value in tokens.items():
            parts[name].append(value)
    return observed_tokens({name: np.concatenate(values) for name, values in parts.items()}, unobserved), settings


def observed_tokens(tokens: dict[str, np.ndarray], unobserved: str) -> dict[str, np.ndarray]:
    """The positions a head trains on, from every proposed position (`label` NaN where unobserved): `skip` keeps the
    reached ones (the survival likelihood), `reject` labels the unreached 0; with their `reach` and `survival`."""
    if unobserved not in UNOBSERVED:
        raise UsageError(f"data.unobserved {unobserved!r} is not one of {', '.join(UNOBSERVED)}")
    kept = ~np.isnan(tokens["label"]) if unobserved == "skip" else np.ones(len(tokens["label"]), bool)
    flat = {name: value[kept] for name, value in tokens.items()}
    flat["label"] = np.nan_to_num(flat["label"], nan=0.0)
    if not len(flat["label"]):
        raise UsageError("the logs hold no verified draft position; log a server that drafted")
    flat["reach"], flat["survival"] = reach_and_survival(flat["label"], flat["position"], flat["start"], flat["row"])
    return flat


def reach_and_survival(label: np.ndarray, position: np.ndarray, start: np.ndarray, row: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Per kept position, the product of its round's earlier kept labels (reach) and up to it (survival)."""
    reach, survival = np.ones(len(label)), np.ones(len(label))
    running, previous = 1.0, None
    for index in range(len(label)):
        key = (row[index], start[index])
        if key != previous:
            running, previous = 1.0, key
        reach[index] = running
        running *= float(label[index])
        survival[index] = running
    return reach, survival


class LogDataModule(LookupDataModule):
    """Labelled positions rebuilt from server logs (module docstring), split by prompt as `LookupDataModule` splits.

    Args:
        logs: the JSONL files (vLLM's proposer log and its outputs' metrics, or our decoder's round log).
        unobserved: `skip` (train on the reached positions: the survival likelihood) or `reject` (label them 0).
        val_fraction, split_seed, batch_size: as `LookupDataModule`'s.
    """

    def __init__(self, logs: list[str], unobserved: str = "skip", val_fraction: float = 0.1, split_seed: int = 0,
                 batch_size: int = 512) -> None:
        super().__init__(",".join(logs), val_fraction, split_seed, batch_size, target_state=False)
        if unobserved not in UNOBSERVED:
            raise UsageError(f"data.unobserved {unobserved!r} is not one of {', '.join(UNOBSERVED)}")
        self.logs, self.unobserved = list(logs), unobserved
        self.settings: dict[str, Any] | None = None

    @property
    def manifest(self) -> dict[str, Any]:
        """What the head records of its training data: the logs' draft settings and their digest."""
        if self.settings is None:
            self.setup()
        digest = hashlib.sha256()
        for name in self.logs:
            digest.update(Path(name).read_bytes())
        return {"fingerprint": digest.hexdigest()[:16],
                "identity": {"draft": {"kind": "lookup", **(self.settings or {})}, "sampling": "as served",
                             "target_states": False, "labels": f"server logs, unobserved {self.unobserved}"}}

    def tokens(self) -> dict[str, np.ndarray]:
        """The positions to train on (`log_tokens`), `prompt_id` among them."""
        tokens, self.settings = log_tokens(self.logs, self.unobserved)
        return tokens

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        tokens = self.tokens()
        split = np.array([prompt_split(str(p), self.split_seed, self.val_fraction) for p in tokens.pop("prompt_id")])
        self.splits = {name: {key: value[split == name] for key, value in tokens.items()} for name in ("train", "val")}
        if not len(self.splits["train"]["label"]) or not len(self.splits["val"]["label"]):
            raise UsageError("the split of the logs by prompt leaves a side without positions; log more prompts or "
                             "change data.val_fraction")
