"""Offline: what a free draft's token heads add over the match statistics alone and over vLLM's acceptance table.

Reads lookup labels (`specheads gen --drafter.kind lookup|suffix`): a fitting folder (the table is fitted there, as
the heads were trained there) and a held-out folder the predictors are judged on, per prompt family (the prompts
file's `category`). Two views of the same held-out proposals:

- conditional: â_k against the label p(x_k | context, x_<k) at the tokens a decode reaches (weight: the product of
  the earlier labels, 1 or 0 at T = 0): what a stop rule reads;
- survival: Π_{j≤k} â_j against the product of the labels up to k, at every proposed token: what a planner reads
  (the expected accepted length is its sum over k).

Predictors: each head given (`--head NAME=DIR`: stop heads as they are, expected heads' survival made conditional);
vLLM's table, (accepted + 1) / (observed + 2) per (source, match-length bucket, position) counted at the reached tokens
of the fitting folder (its online form halves its counts every 1024 steps; fitted on the whole folder it is at its
best); the proposal's own frequency score and its running product; the match length (a rank only: no calibration).

    python benchmarks/lookup_heads.py --fit runs/lookup/gen-dev-t0 --heldout runs/lookup/gen-confirm-t0 \
        --prompts benchmarks/prompts/lookup-confirm.jsonl --head stop=runs/lookup/train-stop/head ... \
        --out runs/lookup/heads-offline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specheads.artifacts.metrics import binary_kl, expected_calibration_error, soft_auc
from specheads.dataset.lookup import load_lookup
from specheads.decoding.free_rules import length_bucket
from specheads.lookup.features import FEATURE_NAMES
from specheads.lookup.token_head import TokenHead, conditional_estimates
from specheads.plumbing.files import write_json_atomic
from specheads.train.lookup import flat_tokens


def column(tokens: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A token feature by name."""
    return tokens["features"][:, FEATURE_NAMES.index(name)]


def table_keys(tokens: dict[str, np.ndarray]) -> np.ndarray:
    """(source, match-length bucket, position) of every token, as rows of ints: vLLM's buckets, as the online
    table's (`specheads.decoding.free_rules.length_bucket`)."""
    bucket = np.array([length_bucket(int(n)) for n in column(tokens, "match_length")], dtype=np.int64)
    return np.stack([column(tokens, "from_output").astype(np.int64), bucket, tokens["position"]], axis=1)


def vllm_table(fit: dict[str, np.ndarray], heldout: dict[str, np.ndarray]) -> np.ndarray:
    """vLLM's estimate (accepted + 1) / (observed + 2) for every held-out token, counted on the fitting tokens a
    decode reaches (soft labels count their expectation)."""
    counts: dict[tuple[int, ...], list[float]] = {}
    for key, label, reach in zip(map(tuple, table_keys(fit)), fit["label"], fit["reach"]):
        entry = counts.setdefault(key, [0.0, 0.0])
        entry[0] += reach * label
        entry[1] += reach
    return np.array([(counts.get(key, [0.0, 0.0])[0] + 1) / (counts.get(key, [0.0, 0.0])[1] + 2)
                     for key in map(tuple, table_keys(heldout))])


def per_proposal(values: np.ndarray, position: np.ndarray, transform) -> np.ndarray:
    """`transform` applied to each proposal's slice of `values` (a proposal starts at position 1)."""
    starts = np.flatnonzero(position == 1)
    ends = np.append(starts[1:], len(values))
    return np.concatenate([transform(values[a:b]) for a, b in zip(starts, ends)])


def head_estimates(folder: Path, tokens: dict[str, np.ndarray]) -> np.ndarray:
    """A head's conditional estimates â_k of every held-out token."""
    head = TokenHead.load(folder)
    state = tokens.get("target_state") if head.target_state_size else None
    raw = head.probabilities(tokens["features"], state)
    return per_proposal(raw, tokens["position"], lambda part: conditional_estimates(part, head.head_type))


def metrics(label: np.ndarray, prediction: np.ndarray, weight: np.ndarray, calibrated: bool) -> dict[str, float]:
    """AUC (weighted, soft labels), and for probabilities ECE and binary KL."""
    kept = weight > 0
    label, prediction, weight = label[kept], prediction[kept], weight[kept]
    found = {"auc": soft_auc(label, prediction, weight), "tokens": int(kept.sum())}
    if calibrated:
        found |= {"ece": expected_calibration_error(label, prediction, weights=weight),
                  "binary_kl": binary_kl(label, np.clip(prediction, 1e-6, 1 - 1e-6), weight)}
    return found


def judge(tokens: dict[str, np.ndarray], predictors: dict[str, tuple[np.ndarray, bool]],
          families: np.ndarray) -> dict[str, dict]:
    """Both views of every predictor, overall and per family."""
    report: dict[str, dict] = {}
    for family in ["all", *sorted(set(families))]:
        chosen = np.ones(len(families), bool) if family == "all" else families == family
        for name, (conditional, calibrated) in predictors.items():
            survival = per_proposal(conditional, tokens["position"], np.cumprod)
            report.setdefault(family, {})[name] = {
                "conditional": metrics(tokens["label"][chosen], conditional[chosen], tokens["reach"][chosen], calibrated),
                "survival": metrics(tokens["survival"][chosen], survival[chosen], np.ones(int(chosen.sum())), calibrated),
            }
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", required=True, help="lookup labels the table is counted on (the heads' training data)")
    parser.add_argument("--heldout", required=True, help="lookup labels the predictors are judged on")
    parser.add_argument("--prompts", required=True, help="the held-out prompts' JSONL (its `category` is the family)")
    parser.add_argument("--head", action="append", default=[], help="NAME=DIR of an exported token head (repeatable)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    heads = dict(item.split("=", 1) for item in args.head)
    rows = load_lookup(args.heldout)
    with_states = any(TokenHead.load(folder).target_state_size for folder in heads.values())
    tokens = flat_tokens(rows, with_states)
    fit = flat_tokens(load_lookup(args.fit), False)
    category = {record["id"]: record.get("category", "all")
                for record in map(json.loads, Path(args.prompts).read_text().splitlines())}
    families = np.array([category.get(prompt, "unknown") for prompt in rows["prompt_id"]])[tokens["row"]]
    predictors = {name: (head_estimates(Path(folder), tokens), True) for name, folder in heads.items()}
    predictors |= {"vllm_table": (vllm_table(fit, tokens), True), "score": (column(tokens, "score"), True),
                   "product_score": (column(tokens, "product_score"), True),
                   "match_length": (column(tokens, "match_length") / 100.0, False)}
    report = {"fit": args.fit, "heldout": args.heldout, "results": judge(tokens, predictors, families)}
    write_json_atomic(Path(args.out), report)
    for family, found in report["results"].items():
        line = ", ".join(f"{name} {values['conditional']['auc']:.3f}/{values['survival']['auc']:.3f}"
                         for name, values in found.items())
        print(f"{family}: AUC conditional/survival: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
