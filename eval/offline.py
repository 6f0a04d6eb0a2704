"""Offline evaluation: the head and every training-free signal scored on the same held-out labelled tokens.

Tokens come from the prompts the head's training split held out (the same prompt hash rule). Each
signal gets AUC (expectation over soft labels, and against seeded Bernoulli draws), PR-AUC, Brier,
ECE and binary KL where it is a probability, with bootstrap intervals over prompts (not tokens) on AUC
and binary KL, and a paired interval on the head's AUC margin over the best training-free signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specheads.artifacts.checkpoint import TrainedHead
from specheads.artifacts.metrics import (
    baseline_scores,
    bernoulli_auc,
    binary_kl,
    brier,
    calibration_bins,
    classification_metrics,
    expected_calibration_error,
    soft_auc,
    soft_pr_auc,
)
from specheads.dataset.datamodule import AcceptanceDataModule
from specheads.dataset.prompts import prompt_digest
from specheads.dataset.targets import draft_features, head_inputs, markov_argument, stale_target_states
from specheads.decoding.calibration import MARGIN_REVISION_START, MAX_LOG_ODDS_START, OnlineLogistic
from specheads.decoding.online import LOGIT_CLAMP, AdaEdl, Outcome, VllmEstimator
from specheads.decoding.rules import Drafted
from specheads.heads import STORED_SIGNALS, TARGET_STALENESS, PositionCalibration
from specheads.heads.calibration import cumulative_products, round_windows, sigmoid
from specheads.heads.calibration_fit import fit_position_temperatures
from specheads.model_outputs.signals import top_two_margin

BASELINES = ("svip_entropy", "draft_top1", "draft_prob", "vllm_online", "vllm_current", "vllm_margin", "adaedl",
             "sv_companion", "dspark_confidence", "dspark_confidence_ts")
HEAD_SIGNALS = ("head", "head_online", "head_online_margin")
"""The head's scores: as trained, and calibrated online from the outcomes before each token (`online_scores`), on its
logit alone or beside the top-2 margin."""
SIGNAL_ORDER = (*HEAD_SIGNALS, *BASELINES, "beta_oracle", "label_ceiling", "constant")
DRAFTER_SIGNALS = ("dspark_confidence", "dspark_confidence_ts")
"""A DSpark drafter's own confidence head, where the data stores its score (`drafter_score`): as it is, and with the
per-position temperatures fitted on the calibration prompts (`drafter_temperatures`), as SGLang applies them."""
PROBABILITY_SIGNALS = (*HEAD_SIGNALS, "draft_top1", "draft_prob", "vllm_online", "vllm_current", "vllm_margin", "sv_companion",
                       *DRAFTER_SIGNALS, "beta_oracle", "label_ceiling", "constant")
READS_DRAWN_TOKEN = {"svip_entropy": False, "draft_top1": False, "draft_prob": True, "vllm_online": True,
                     "vllm_current": False, "vllm_margin": False, "adaedl": False, "sv_companion": True,
                     "dspark_confidence": False, "dspark_confidence_ts": False,
                     "beta_oracle": False, "label_ceiling": True, "constant": False}
"""Whether a signal's score of ŷ_k reads ŷ_k itself: only the scores that do not may rank drafted positions for a
verify budget (docs/decoding-core.md "Verify budgets"); the head's own answer is its `decides`."""
BOUND_SIGNALS = ("adaedl",)
"""Scores that claim a lower bound on the acceptance probability but may leave [0, 1]: ranked as they are (AUC),
clipped to [0, 1] for the probability metrics (Brier, ECE, binary KL)."""
SPRINTER_TAUS = (1.0, 1.2, 1.5)
POSITION_COLUMNS = ("logp", *STORED_SIGNALS, "beta", "accept")
"""The per-position data columns a token table keeps beside the label and the head's prediction."""
TOKEN_COLUMNS = ("label", "prediction", "logit", *POSITION_COLUMNS, "group", "row", "position")
INTEGER_COLUMNS = ("group", "row", "position")


@dataclass
class TokenTable:
    """Per-token arrays of the evaluated split, aligned and sorted by (row, position); `group` is the token's prompt
    (for the bootstrap), `logit` the head's logit plus its class-weight correction (prediction = σ(logit), with no
    position calibration)."""

    label: np.ndarray
    prediction: np.ndarray
    logit: np.ndarray
    logp: np.ndarray
    logq: np.ndarray
    entropy: np.ndarray
    top1: np.ndarray
    beta: np.ndarray
    accept: np.ndarray
    group: np.ndarray
    row: np.ndarray
    position: np.ndarray
    prompts: int
    sv_companion: np.ndarray | None = None  # SV's companion predictor (eval.companion), when eval was asked for it
    top2: np.ndarray | None = None  # the draft's second-largest q; None for data labelled before it was stored
    depth: np.ndarray | None = None  # each token's depth in its round: a feature drafter's data (data_gen.drafter_labels)
    drafter_score: np.ndarray | None = None  # a DSpark drafter's own confidence, where the data stores it
    drafter_temperatures: PositionCalibration | None = None  # its per-position temperatures (`drafter_temperatures`)

    def scores(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Every signal's score per token (higher = more likely accepted); the margin's only where the data has
        `top2` (`margin_note` says so otherwise)."""
        companion = {} if self.sv_companion is None else {"sv_companion": self.sv_companion}
        online = {"vllm_current": online_scores(np.c_[logits(self.top1)], MAX_LOG_ODDS_START, self.label, seed),
                  "head_online": online_scores(np.c_[self.logit], (1.0, 0.0), self.label, seed)}
        if self.top2 is not None:
            margin = np.c_[top_two_margins(self.top1, self.top2)]
            online.update(vllm_margin=online_scores(margin, MARGIN_REVISION_START, self.label, seed),
                          head_online_margin=online_scores(np.c_[self.logit, margin], (1.0, 0.0, 0.0), self.label, seed))
        return {"head": self.prediction, **baseline_scores(self.logq, self.entropy, self.top1),
                "vllm_online": vllm_online_scores(np.exp(self.logq), self.label, seed), **online,
                "adaedl": adaedl_scores(self.entropy, self.label, self.row, seed), **companion, **self.drafter_scores(),
                "beta_oracle": self.beta, "label_ceiling": self.label,
                "constant": np.full_like(self.label, self.label.mean())}

    def drafter_scores(self) -> dict[str, np.ndarray]:
        """The DSpark drafter's own confidence (`DRAFTER_SIGNALS`) where the data stores it: as it is, and scaled by
        its per-position temperatures where they were fitted."""
        if self.drafter_score is None:
            return {}
        scores = {"dspark_confidence": self.drafter_score}
        if self.drafter_temperatures is not None:
            scaled = self.drafter_temperatures.logits(logits(self.drafter_score), self.depth)
            scores["dspark_confidence_ts"] = sigmoid(scaled)
        return scores

    def subset(self, index: np.ndarray) -> TokenTable:
        """The tokens at `index` (a bootstrap resample)."""
        values = {name: getattr(self, name)[index] for name in TOKEN_COLUMNS}
        optional = {name: None if getattr(self, name) is None else getattr(self, name)[index]
                    for name in ("sv_companion", "top2", "depth", "drafter_score")}
        return TokenTable(**values, prompts=self.prompts, **optional, drafter_temperatures=self.drafter_temperatures)

    @property
    def margin_note(self) -> str | None:
        """Why the top-2 margin's scores are missing, or None when they are there."""
        if self.top2 is not None:
            return None
        return ("the top-2 margin's scores (vllm_margin, head_online_margin) are left out: this data was labelled "
                "before gen stored the draft's second-largest q (`top2`, labeller 3); label it again to score them")


ONLINE_REFIT_TOKENS = 100
"""Held-out tokens between two refits of an online fit scored offline: one token a step and a refit every 100 steps,
as the `vllm_online` row's estimator runs along the same tokens."""
ONLINE_SIGNALS = ("head_online", "head_online_margin", "vllm_current", "vllm_margin")
"""The scores of online fits: each also gets the cumulative calibration the head gets (`cumulative_calibration`)."""


def logits(probability: np.ndarray) -> np.ndarray:
    """log(p / (1 − p)) per token, clamped to ±40 (`specheads.decoding.online.drawn_logit`)."""
    with np.errstate(divide="ignore"):
        return np.clip(np.log(probability) - np.log1p(-probability), -LOGIT_CLAMP, LOGIT_CLAMP)


def top_two_margins(top1: np.ndarray, top2: np.ndarray) -> np.ndarray:
    """The top-2 logit margin per token (`specheads.model_outputs.signals.top_two_margin`)."""
    return np.array([top_two_margin(a, b) for a, b in zip(top1.tolist(), top2.tolist())])


def online_scores(features: np.ndarray, start: tuple[float, ...], label: np.ndarray, seed: int) -> np.ndarray:
    """An online logistic fit (`specheads.decoding.calibration.OnlineLogistic`: vLLM's merged estimator's fit, slopes
    and intercept from `start`) run causally along the held-out tokens in their order, as `vllm_online_scores` runs
    vLLM's older estimator: each token is scored by the fit made from the tokens before it, then its outcome, a seeded
    Bernoulli draw of its soft label, is folded in; a step is one token and the fit refits from the last
    `ONLINE_REFIT_TOKENS` tokens (it changes only then, so a window's tokens are scored together). Offline tokens have
    no position in a round, so the fit has one intercept."""
    fit = OnlineLogistic(1, start[:-1], start[-1], refit_every=1)
    outcomes = np.random.default_rng(seed).uniform(size=len(label)) < label
    scores = np.empty(len(label))
    for begin in range(0, len(label), ONLINE_REFIT_TOKENS):
        window = slice(begin, begin + ONLINE_REFIT_TOKENS)
        scores[window] = fit.predictions(features[window], np.zeros(len(features[window]), dtype=int))
        fit.fold(features[window], [1] * len(features[window]), outcomes[window])
        fit.step()
    return scores


def vllm_online_scores(prob: np.ndarray, label: np.ndarray, seed: int) -> np.ndarray:
    """vLLM's online acceptance estimator (`specheads.decoding.online.VllmEstimator`) run causally along the held-out
    tokens in their order (response by response): each token is scored by the fit made from the tokens before it, then
    its outcome, a seeded Bernoulli draw of its soft label (what decoding would observe), joins the window. Offline
    tokens have no position in a round, so the fit has one intercept, and a step is one token (refit every 100)."""
    estimator = VllmEstimator(threshold=0.0, positions=1)
    outcomes = np.random.default_rng(seed).uniform(size=len(prob)) < label
    scores = np.empty(len(prob))
    for index, (q, accepted) in enumerate(zip(prob.tolist(), outcomes.tolist())):
        scores[index] = estimator.probability(Drafted(index=1, prob=q, entropy=0.0, acceptance=1.0))
        estimator.observe({0: [Outcome(1, q, accepted)]})
    return scores


def adaedl_scores(entropy: np.ndarray, label: np.ndarray, row: np.ndarray, seed: int) -> np.ndarray:
    """AdaEDL's adapted bound (`specheads.decoding.online.AdaEdl`), bound + δ, run causally along each held-out
    response (δ starts at 0 for each, as for each request): a token is scored with the δ of the tokens before it,
    then its outcome, a seeded Bernoulli draw of its soft label, moves δ. A score to rank by, not a probability (it
    may leave [0, 1]): AUC ranks it as it is, the probability metrics take it clipped (`BOUND_SIGNALS`)."""
    planner = AdaEdl(threshold=0.0)
    outcomes = np.random.default_rng(seed).uniform(size=len(entropy)) < label
    scores = np.empty(len(entropy))
    previous = None
    for index, (h, accepted, response) in enumerate(zip(entropy.tolist(), outcomes.tolist(), row.tolist())):
        if response != previous:
            planner.admit(0)
            previous = response
        scores[index] = planner.estimate(0, h)
        planner.observe({0: [Outcome(1, 0.0, accepted, h)]})
    return scores


@torch.no_grad()
def collect_tokens(trained: TrainedHead, data: AcceptanceDataModule, draft: torch.nn.Module | None,
                   split: str = "val") -> TokenTable:
    """The head's predictions and the per-token signals on one split of the data: the held-out prompts by default,
    `"train"` for the training prompts (a training-vs-validation comparison)."""
    head = trained.head
    embeddings = draft.get_input_embeddings() if head.candidate_embedding_size and draft is not None else None
    columns: dict[str, list[np.ndarray]] = {name: [] for name in TOKEN_COLUMNS}
    optional: dict[str, list[np.ndarray]] = {name: [] for name in ("top2", "depth", "drafter_score")}
    prompt_index: dict[str, int] = {}
    rows = data.splits[split]["prompt_id"]
    start = 0
    data.with_target_states = bool(head.target_state_size)
    data.with_markov = bool(getattr(head, "markov_rank", 0))
    for index, batch in enumerate(data.ordered_batches(split, with_features=True)):
        size = len(batch["valid"])
        ids = rows[start : start + size]
        start += size
        features = batch["features"] if "features" in batch else draft_features(draft, batch, batch["valid"].shape[1])
        hidden, signals, embedding, label, mask = head_inputs(batch, features, trained.reads, trained.purpose,
                                                              head.extra_features, trained.tau, trained.contexts, embeddings,
                                                              realised=True)
        target = (stale_target_states(batch, mask, TARGET_STALENESS, seed=index)
                  if head.target_state_size else (None, None))
        markov = markov_argument(batch, mask, trained.reads, head)
        logit = (head(hidden, signals, embedding, *target, **markov) + head.logit_correction).double().cpu()
        columns["logit"].append(logit.numpy())
        columns["prediction"].append(torch.sigmoid(logit).numpy())
        columns["label"].append(label.numpy())
        row, position = mask.nonzero(as_tuple=True)
        columns["row"].append((row + start - size).numpy())
        columns["position"].append(position.numpy())
        for name in POSITION_COLUMNS:
            columns[name].append(batch[name][mask].numpy())
        for name, parts in optional.items():
            if name in batch:
                parts.append(batch[name][mask].numpy())
        groups = torch.tensor([prompt_index.setdefault(i, len(prompt_index)) for i in ids]).unsqueeze(1)
        columns["group"].append(groups.expand_as(mask)[mask].numpy())
    arrays = {name: np.concatenate(parts).astype(np.int64 if name in INTEGER_COLUMNS else np.float64)
              for name, parts in columns.items()}
    return TokenTable(**arrays, prompts=len(prompt_index),
                      **{name: np.concatenate(parts).astype(np.int64 if name == "depth" else np.float64) if parts else None
                         for name, parts in optional.items()})


def drafter_temperatures(trained: TrainedHead, data: AcceptanceDataModule, draft: torch.nn.Module | None,
                         max_positions: int) -> tuple[PositionCalibration | None, str]:
    """(the per-position temperatures of a DSpark drafter's own confidence, fitted as SGLang applies them
    (`heads.calibration_fit.fit_position_temperatures`) on the tokens of the head's calibration prompts, or of its training
    prompts where it has none, never on the held-out ones; which prompts they were): (None, why) where those prompts
    hold no drafted token."""
    split = trained.split
    source = "calibration" if split.get("calibration_prompts") else "training"
    wanted = set(split.get("calibration_prompts") or split.get("train_prompts") or [])
    rows = data.splits["train"]
    ids = rows.with_format("numpy", columns=["prompt_ids"])["prompt_ids"]
    data.splits["drafter_calibration"] = rows.select([i for i, row in enumerate(ids) if prompt_digest(row) in wanted])
    try:
        table = collect_tokens(trained, data, draft, split="drafter_calibration") if len(
            data.splits["drafter_calibration"]) else None
    finally:
        del data.splits["drafter_calibration"]
    if table is None or table.drafter_score is None or not len(table.label):
        return None, f"not fitted: the head's {source} prompts hold no drafted token"
    fitted = fit_position_temperatures(logits(table.drafter_score), table.accept, table.row, table.position,
                                       max_positions, table.depth)
    return fitted, f"fitted on the head's {source} prompts ({table.prompts} prompts, {len(table.label)} tokens)"


def as_probability(name: str, score: np.ndarray) -> np.ndarray:
    """A signal's scores as the probability metrics take them: a bound clipped to [0, 1] (`BOUND_SIGNALS`), else as
    they are."""
    return np.clip(score, 0.0, 1.0) if name in BOUND_SIGNALS else score


def signal_metrics(name: str, label: np.ndarray, score: np.ndarray, bins: int, seed: int) -> dict[str, float | None]:
    """The metrics of one signal; probability metrics only for signals that are probabilities (or bound one)."""
    if name in PROBABILITY_SIGNALS:
        metrics: dict[str, float | None] = classification_metrics(label, score, bins)
    elif name in BOUND_SIGNALS:
        metrics = {**classification_metrics(label, as_probability(name, score), bins), "auc": soft_auc(label, score),
                   "pr_auc": soft_pr_auc(label, score)}
    else:
        metrics = {"auc": soft_auc(label, score), "pr_auc": soft_pr_auc(label, score), "brier": None, "ece": None,
                   "binary_kl": None}
    metrics["auc_bernoulli"] = bernoulli_auc(label, score, seed)
    return metrics


def bootstrap_indices(group: np.ndarray, resamples: int, seed: int) -> list[np.ndarray]:
    """Token indices of `resamples` resamples of the prompts (with replacement)."""
    members = [np.flatnonzero(group == g) for g in range(int(group.max()) + 1)]
    generator = np.random.default_rng(seed)
    return [np.concatenate([members[g] for g in generator.integers(0, len(members), len(members))])
            for _ in range(resamples)]


def interval(values: list[float]) -> list[float] | None:
    """The central 95 % interval of bootstrap values (None when none is finite)."""
    finite = np.asarray([v for v in values if v is not None and math.isfinite(v)])
    return [float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))] if len(finite) else None


def offline_metrics(table: TokenTable, resamples: int = 200, seed: int = 0, bins: int = 10,
                    scores: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """`{signal: metrics with auc_ci and binary_kl_ci}` plus the head's paired AUC margin over the best baseline and,
    where the data has `top2`, over the top-2 margin fitted online (`vllm_margin`); `scores`: `table.scores(seed)`
    when already computed."""
    scores = table.scores(seed) if scores is None else scores
    names = [name for name in SIGNAL_ORDER if name in scores]
    result = {name: signal_metrics(name, table.label, scores[name], bins, seed) for name in names}
    best = max((name for name in BASELINES if name in scores), key=lambda name: result[name]["auc"])
    samples = {name: {"auc": [], "binary_kl": []} for name in names}
    for index in bootstrap_indices(table.group, resamples, seed):
        label = table.label[index]
        for name in names:
            score = scores[name][index] if name != "constant" else np.full(len(index), label.mean())
            samples[name]["auc"].append(soft_auc(label, score))
            if name in PROBABILITY_SIGNALS or name in BOUND_SIGNALS:
                samples[name]["binary_kl"].append(binary_kl(label, as_probability(name, score)))
    for name in names:
        result[name]["auc_ci"] = interval(samples[name]["auc"])
        result[name]["binary_kl_ci"] = interval(samples[name]["binary_kl"])

    def head_over(other: str) -> dict[str, Any]:
        differences = [a - b for a, b in zip(samples["head"]["auc"], samples[other]["auc"])]
        return {"baseline": other, "auc_margin": result["head"]["auc"] - result[other]["auc"],
                "auc_margin_ci": interval(differences)}

    comparisons = {"head_vs_best_baseline": head_over(best)}
    if "vllm_margin" in scores:
        comparisons["head_vs_top2_margin"] = head_over("vllm_margin")
    for name in DRAFTER_SIGNALS:
        if name in scores:
            comparisons[f"head_vs_{name}"] = head_over(name)
    return {"signals": result, **comparisons}


def calibration_table(table: TokenTable, bins: int = 10) -> dict[str, list[float]]:
    """The head's reliability diagram: per-bin count, mean prediction and mean label."""
    return {name: [float(v) for v in values] for name, values in calibration_bins(table.label, table.prediction, bins).items()}


def sprinter_distance(table: TokenTable, threshold: float) -> float:
    """The total-variation distance of SPRINTER's output from the target's, per generated token, at `threshold`.

    A drafted token ŷ ~ q that the verifier passes (â ≥ threshold) is kept unverified; any other goes through the
    p/q test. Per context the output then differs from p by exactly Σ over passed tokens of max(0, q − p), which is
    E_{ŷ~q}[passed · (1 − min(1, p/q))]: the mean over the stored drafted tokens of passed · (1 − accept).
    """
    passed = table.prediction >= threshold
    return float(np.mean(passed * (1.0 - table.accept))) if len(passed) else float("nan")


def sprinter_operating_points(table: TokenTable, threshold: float, taus: tuple[float, ...] = SPRINTER_TAUS) -> dict:
    """A verifier at `threshold`: its SPRINTER distance from the target (`sprinter_distance`), and FPR and TPR
    against the labels of each τ (a positive is an acceptable token, q/p ≤ τ; the verifier passes it unverified
    when â ≥ threshold)."""
    passed = table.prediction >= threshold
    points = []
    for tau in taus:
        acceptable = (table.logq - table.logp) <= math.log(tau)
        negatives, positives = max(int((~acceptable).sum()), 1), max(int(acceptable.sum()), 1)
        points.append({"tau": tau, "fpr": float((passed & ~acceptable).sum() / negatives),
                       "tpr": float((passed & acceptable).sum() / positives)})
    return {"threshold": threshold, "tv_distance": sprinter_distance(table, threshold),
            "passed_share": float(passed.mean()) if len(passed) else float("nan"), "operating_points": points}


def cumulative_calibration(table: TokenTable, calibration: PositionCalibration | None, max_positions: int,
                           bins: int = 10, resamples: int = 200, seed: int = 0,
                           scores: dict[str, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """Per round position k = 1..max_positions: AUROC, ECE and Brier of the cumulative product Π_{j≤k} â_j against the
    chance that all k candidates are accepted (Π min(1, p/q)), over every run of k consecutive drafted candidates of
    the held-out tokens, before and (when the head carries one) after its per-position calibration, with the
    reliability bins of each and the ECE's 95 % interval over resampled prompts (`ece_ci`: its sampling noise, what
    an ECE goal is judged against). Given `scores` (`TokenTable.scores`), the same for each online fit's
    (`ONLINE_SIGNALS`; stage: its name), whose calibration is the fit made causally along the tokens, and for a DSpark
    drafter's own confidence with and without its temperatures (`DRAFTER_SIGNALS`). On a feature drafter's data a
    window is a round at depths 1..k (`heads.calibration.round_windows`)."""
    windows = round_windows(table.row, table.position, max_positions, table.depth)
    stages: list[tuple[str, list[tuple[np.ndarray, np.ndarray]]]] = [
        ("raw", cumulative_products(table.logit, table.accept, windows, None))]
    if calibration is not None:
        stages.append(("calibrated", cumulative_products(table.logit, table.accept, windows, calibration)))
    stages += [(name, [(scores[name][index].prod(axis=1), table.accept[index].prod(axis=1)) for index in windows])
               for name in (*ONLINE_SIGNALS, *DRAFTER_SIGNALS) if name in (scores or {})]
    rows = []
    for stage, products in stages:
        for k, (product, label) in enumerate(products, start=1):
            if not len(label):
                continue
            group = table.group[windows[k - 1][:, 0]]
            rows.append({"k": k, "stage": stage, "windows": len(label), "mean_label": float(label.mean()),
                         "mean_prediction": float(product.mean()), "auroc": soft_auc(label, product),
                         "ece": expected_calibration_error(label, product, bins),
                         "ece_ci": interval([expected_calibration_error(label[index], product[index], bins)
                                             for index in bootstrap_indices(group, resamples, seed)]),
                         "brier": brier(label, product),
                         "bins": {name: [float(v) for v in values]
                                  for name, values in calibration_bins(label, product, bins).items()}})
    return rows
