"""The bias of training a token head from logs (`specheads train lookup from-logs`), measured against a head trained
on full gen labels of the same prompts (`benchmarks/lookup_from_logs.py`).

At T = 0 a greedy response decides every round of every rule (`specheads.decoding.free_replay`), so a running rule's
round log is replayed from gen's greedy responses with no forward (`replayed_log`), in the format our decoder writes
(`decoder_log_lines`, each request carrying its prompt's id so that the logs split by prompt exactly as gen's labels
do). The heads are then judged on one held-out set: the validation prompts' full labels (every proposed token a decode
can reach, to gen's depth), by AUC over all depths, per depth slice and at the round starts a decode verifying every
token reaches, each head's difference from the baseline's with a bootstrap interval over prompts (`sliced_aucs`); and
by the counted speedup of the rule each head drives, paired per prompt (`paired_speed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from specheads.artifacts.metrics import expected_calibration_error, soft_auc
from specheads.dataset.lookup import load_lookup
from specheads.decoding.costs import CostCurve
from specheads.decoding.free_replay import geometric_interval, make_rule, replay_speedups, round_log
from specheads.lookup.token_head import TokenHead
from specheads.train.lookup import LookupDataModule
from specheads.train.lookup_logs import decoder_log_lines
from specheads.train.lookup_loop import NGRAM  # the replay's proposer settings

SLICES: dict[str, Callable[[dict[str, np.ndarray]], np.ndarray]] = {
    "all": lambda tokens: np.ones(len(tokens["position"]), bool),
    "depth<=8": lambda tokens: tokens["position"] <= 8,
    "depth>8": lambda tokens: tokens["position"] > 8,
    "round starts": lambda tokens: tokens["round_start"],  # the starts a decode verifying every token reaches
}


def replayed_log(rows: Sequence[dict[str, Any]], rule: str, max_draft: int,
                 curve: CostCurve | None = None) -> list[dict[str, Any]]:
    """Our decoder's round log (JSON records) of `rule` decoding every row's greedy response (`prompt_id`,
    `prompt_ids`, `target_ids`) in order, its proposer reading `max_draft` tokens a round whatever the rule verifies
    (a fixed K below it leaves the rest of each proposal unverified), its planner reading the verify `curve`."""
    policy, planner = make_rule(rule, max_draft, None, curve)
    pairs = [(list(row["prompt_ids"]), list(row["target_ids"])) for row in rows]
    records, proposed = round_log(pairs, policy, planner, max_draft, propose=max_draft)
    return decoder_log_lines({"k": max_draft, **NGRAM, "draft": "lookup"}, {i: p for i, (p, _) in enumerate(pairs)},
                             {i: r for i, (_, r) in enumerate(pairs)}, records, proposed,
                             {i: str(row["prompt_id"]) for i, row in enumerate(rows)})


def held_out_tokens(labels: str, val_fraction: float, split_seed: int) -> dict[str, np.ndarray]:
    """The validation prompts' labelled tokens of gen's lookup labels (`LookupDataModule`'s split), each with its
    prompt's id (`prompt_id`)."""
    data = LookupDataModule(labels, val_fraction, split_seed)
    data.setup()
    tokens = dict(data.splits["val"])
    tokens["prompt_id"] = np.asarray(load_lookup(labels)["prompt_id"])[tokens["row"]]
    return tokens


def head_predictions(heads: dict[str, str], features: np.ndarray) -> dict[str, np.ndarray]:
    """Each head's â on `features`, by name."""
    return {name: TokenHead.load(folder, "lookup").probabilities(features) for name, folder in heads.items()}


def slice_auc(tokens: dict[str, np.ndarray], scores: np.ndarray, kept: np.ndarray) -> float:
    """The stop head's validation AUC (weighted by reach, as `LookupHeadModule` logs it) on the `kept` tokens."""
    kept = kept & (tokens["reach"] > 0)
    return soft_auc(tokens["label"][kept], scores[kept], tokens["reach"][kept])


def sliced_aucs(predictions: dict[str, np.ndarray], tokens: dict[str, np.ndarray], baseline: str,
                resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Per slice of the tokens (`SLICES`): each head's AUC and ECE, and its AUC minus the baseline's with a bootstrap 95 %
    interval over prompts (the same prompts resampled for every head)."""
    prompts = np.unique(tokens["prompt_id"])
    rows = {p: np.flatnonzero(tokens["prompt_id"] == p) for p in prompts}
    draws = np.random.default_rng(seed).integers(0, len(prompts), (resamples, len(prompts)))
    found: dict[str, Any] = {}
    for depth, pick in SLICES.items():
        kept = pick(tokens)
        point = {name: slice_auc(tokens, scores, kept) for name, scores in predictions.items()}
        spread: dict[str, list[float]] = {name: [] for name in predictions}
        for draw in draws:
            index = np.concatenate([rows[prompts[i]] for i in draw])
            sample = {"label": tokens["label"][index], "reach": tokens["reach"][index]}
            base = slice_auc(sample, predictions[baseline][index], kept[index])
            for name, scores in predictions.items():
                spread[name].append(slice_auc(sample, scores[index], kept[index]) - base)
        reached = kept & (tokens["reach"] > 0)
        found[depth] = {name: {"auc": point[name], "ece": expected_calibration_error(
                                   tokens["label"][reached], predictions[name][reached]),
                               "minus_baseline": point[name] - point[baseline],
                               "interval": [float(np.nanpercentile(spread[name], 2.5)),
                                            float(np.nanpercentile(spread[name], 97.5))]}
                        for name in predictions}
        found[depth]["tokens"] = int(reached.sum())
    return {"baseline": baseline, "prompts": len(prompts), "resamples": resamples, "slices": found}


def paired_speed(responses: Iterable[tuple[list[int], list[int]]], heads: dict[str, str], baseline: str, rule: str,
                 max_draft: int, curve: CostCurve | None, resamples: int = 1000) -> dict[str, Any]:
    """The counted speedup of `rule` (a head's rule, e.g. `lookup_plan:0.043`) driven by each head on every (prompt,
    greedy response), forwards priced by the verify `curve`, and per head the geometric mean of its per-prompt ratio
    to the baseline head's with a bootstrap 95 % interval over prompts."""
    pairs = list(responses)
    speedups = {name: np.array(replay_speedups(pairs, [rule], folder, max_draft, curve)[rule])
                for name, folder in heads.items()}
    return {"rule": rule, "baseline": baseline,
            "speedup": {name: geometric_interval(values, resamples) for name, values in speedups.items()},
            "ratio": {name: geometric_interval(values / speedups[baseline], resamples)
                      for name, values in speedups.items() if name != baseline}}
