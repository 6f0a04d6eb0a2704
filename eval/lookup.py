"""`specheads eval --draft-kind lookup|suffix`: a free draft's token head (`specheads train lookup fit`) judged on held-out
lookup labels (`specheads gen --drafter.kind lookup|suffix`) beside the predictors that cost nothing.

Held-out tokens: the validation split of the head's training data when --data is that data (the split the head
recorded), else every row of --data. Two views of the same held-out proposals:

- conditional: â_k against the label p(x_k | context, x_<k) at the tokens a decode reaches (weight: the product of
  the earlier labels, 1 or 0 at T = 0): what a stop rule reads;
- survival: Π_{j≤k} â_j against the product of the labels up to k, at every proposed token: what a planner reads.

Predictors: the head (an expected head's survival made conditional); vLLM's table, (accepted + 1) / (observed + 2)
per (source, match-length bucket, position) counted at the reached tokens of the fitting labels (the head's training
split, or --fit-data; its online form halves its counts every 1024 steps, so fitted on the whole folder it is at its
best); the proposal's own frequency score and its running product; the match length (a rank only: no calibration).
Each gets AUC, and the probabilities ECE and binary KL, overall and per prompt family (the prompts' `category`).

Decoding (prompt lookup at T = 0): every held-out greedy response replayed (`specheads.decoding.free_replay`) under
constant K, vLLM's table (`lookup_table`) and the head's cost-read planner (`lookup_plan`), and an oracle that
verifies exactly what will be accepted; counted speedups priced 1 + t·k per round (t = `PACKED_CPU_TOKEN_COST`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specheads.artifacts.metrics import binary_kl, calibration_bins, expected_calibration_error, soft_auc
from specheads.artifacts.report_file import REPORT_FILE
from specheads.dataset.datamodule import prompt_split
from specheads.dataset.lookup import LOOKUP_FORMAT, flat_tokens, load_lookup
from specheads.dataset.store import read_manifest
from specheads.decoding.free_replay import ORACLE, greedy_refusal, replay_speedups, summarise
from specheads.decoding.free_rules import length_bucket
from specheads.eval.config import EvalConfig
from specheads.eval.plots import PLOTS, predictor_roc_plot, reliability_plot
from specheads.eval.report import write_markdown
from specheads.eval.sweep import CONSTANT_KS
from specheads.lookup.features import FEATURE_NAMES
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST
from specheads.lookup.token_head import CONFIG, TokenHead, conditional_estimates, read_config
from specheads.lookup.token_head import FORMAT as TOKEN_HEAD_FORMAT
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_files, check_output_folder, write_json_atomic
from specheads.plumbing.lock import folder_lock

FREE_PREDICTORS = ("vllm_table", "score", "product_score", "match_length")
"""The predictors that cost nothing, beside the head."""
FORMAT = "specheads-eval-free-draft"


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


def head_estimates(head: TokenHead, tokens: dict[str, np.ndarray]) -> np.ndarray:
    """A head's conditional estimates â_k of every held-out token."""
    state = tokens.get("target_state") if head.target_state_size else None
    raw = head.probabilities(tokens["features"], state)
    return per_proposal(raw, tokens["position"], lambda part: conditional_estimates(part, head.head_type))


def free_predictors(fit: dict[str, np.ndarray], tokens: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, bool]]:
    """The free predictors' conditional estimates of every held-out token, each with whether it is a probability."""
    return {"vllm_table": (vllm_table(fit, tokens), True), "score": (column(tokens, "score"), True),
            "product_score": (column(tokens, "product_score"), True),
            "match_length": (column(tokens, "match_length") / 100.0, False)}


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
    for family in ["all", *sorted(set(families) - {"all"})]:
        chosen = np.ones(len(families), bool) if family == "all" else families == family
        for name, (conditional, calibrated) in predictors.items():
            survival = per_proposal(conditional, tokens["position"], np.cumprod)
            report.setdefault(family, {})[name] = {
                "conditional": metrics(tokens["label"][chosen], conditional[chosen], tokens["reach"][chosen], calibrated),
                "survival": metrics(tokens["survival"][chosen], survival[chosen], np.ones(int(chosen.sum())), calibrated),
            }
    return report


@dataclass
class FreeInputs:
    """What the checks read before anything heavy loads: the head's config, the labels' manifest, where the table is
    fitted and why no replay runs (None: it does)."""

    head: dict[str, Any]
    manifest: dict[str, Any]
    own_data: bool
    fit: str
    replay_refusal: str | None


def lookup_manifest(path: str, flag: str) -> dict[str, Any]:
    """The manifest of a finished lookup-label folder; refused in one line otherwise."""
    manifest = read_manifest(Path(path))
    if manifest is None or manifest.get("format") != LOOKUP_FORMAT or not manifest.get("complete"):
        raise UsageError(f"{flag} {path} holds no finished lookup labels; make them with `specheads gen --drafter.kind "
                         f"lookup --out {path}`")
    return manifest


def check_free_inputs(config: EvalConfig) -> FreeInputs:
    """Refuse in one line, reading JSON only: a head that is not a token head, labels of another draft kind than the
    head's (or --draft-kind), labels whose token features or target state differ from the head's inputs, fitting
    labels of another kind; and say why the decoding replay is skipped, if it is."""
    head = read_config(Path(config.head), None)
    manifest = lookup_manifest(config.data, "--data")
    identity = manifest["identity"]
    kind, trained_on = identity["draft"]["kind"], head.get("draft_kind")
    if kind != trained_on or kind != config.draft_kind:
        raise UsageError(f"--data {config.data} holds {kind} labels, but the head was trained on {trained_on!r} drafts "
                         f"and --draft-kind is {config.draft_kind}; give labels, head and --draft-kind of one kind")
    if list(identity.get("token_features", [])) != list(head["inputs"]):
        raise UsageError(f"--data {config.data} stores the token features {identity.get('token_features')}, not the "
                         f"head's inputs {head['inputs']}; label again with this version's `specheads gen`")
    state = int(head.get("target_state_size", 0))
    if state and identity.get("target_hidden_size") != state:
        raise UsageError(f"the head reads the target's state (width {state}) but --data {config.data} stores "
                         f"{identity.get('target_hidden_size') or 'none'}; label with `--target-states true`")
    training = head.get("training_data") or {}
    own_data = training.get("fingerprint") == manifest["fingerprint"]
    fit = config.fit_data or (config.data if own_data else training.get("path"))
    if not fit or read_manifest(Path(fit)) is None:
        raise UsageError(f"vLLM's table is counted on the head's training labels, and {fit or 'none'} is not there; "
                         "give --fit-data DIR (lookup labels the table is fitted on)")
    fit_kind = lookup_manifest(fit, "--fit-data")["identity"]["draft"]["kind"]
    if fit_kind != kind:
        raise UsageError(f"--fit-data {fit} holds {fit_kind} labels, not {kind}; fit the table on labels of the same draft")
    return FreeInputs(head, manifest, own_data, fit, replay_refusal(config, manifest))


def replay_refusal(config: EvalConfig, manifest: dict[str, Any]) -> str | None:
    """Why no decoding replay runs (None: it does)."""
    if config.num_decode_prompts == 0:
        return "--num-decode-prompts 0 asks for no decoding"
    if config.draft_kind != "lookup":
        return f"the replay proposes by prompt lookup, and these are {config.draft_kind} labels"
    return greedy_refusal(manifest, config.data)


def free_draft_refusal(head: str, data: str) -> str | None:
    """Why an eval of a draft model's head cannot take this token head or these lookup labels (None: it can)."""
    try:
        config = json.loads((Path(head) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and config.get("format") == TOKEN_HEAD_FORMAT:
        return f"--head {head} is a free draft's token head; give --draft-kind {config.get('draft_kind', 'lookup')}"
    if (read_manifest(Path(data)) or {}).get("format") == LOOKUP_FORMAT:
        return f"--data {data} holds a free draft's lookup labels; give --draft-kind lookup (or suffix) and its token head"
    return None


def split_rows(rows: Any, training: dict[str, Any], side: str) -> Any:
    """The rows of the head's recorded split `side` (`val` or `train`)."""
    split = [prompt_split(prompt, training.get("split_seed", 0), training["val_fraction"]) for prompt in rows["prompt_id"]]
    return rows.select([index for index, name in enumerate(split) if name == side])


def prompt_families(manifest: dict[str, Any]) -> dict[str, str]:
    """Each prompt's `category` where the labels' prompts file (a JSONL) gives one; empty otherwise."""
    source = str((manifest["identity"].get("prompts") or {}).get("source", ""))
    if not source.endswith(".jsonl") or not Path(source).is_file():
        return {}
    records = [json.loads(line) for line in Path(source).read_text(encoding="utf-8").splitlines() if line.strip()]
    return {str(record["id"]): str(record["category"]) for record in records
            if isinstance(record, dict) and "id" in record and "category" in record}


@dataclass
class HeldOut:
    """The held-out rows and their flat tokens, the fitting tokens, each token's prompt family."""

    rows: Any
    tokens: dict[str, np.ndarray]
    fit: dict[str, np.ndarray]
    families: np.ndarray
    row_families: list[str]


def held_out(config: EvalConfig, inputs: FreeInputs) -> HeldOut:
    """Load the held-out rows (the head's validation split of its own data, else all of --data) and the fitting
    rows (the head's training split of its own data, else all of the fitting folder)."""
    training = inputs.head.get("training_data") or {}
    rows = load_lookup(config.data)
    fit_rows = load_lookup(inputs.fit)
    if inputs.own_data:
        rows = split_rows(rows, training, "val")
        if Path(inputs.fit).resolve() == Path(config.data).resolve():
            fit_rows = split_rows(fit_rows, training, "train")
    if not len(rows):
        raise UsageError(f"the head's validation split of {config.data} holds no prompt; label more prompts")
    tokens = flat_tokens(rows, bool(int(inputs.head.get("target_state_size", 0))))
    category = prompt_families(inputs.manifest)
    row_families = [category.get(prompt, "unknown") if category else "all" for prompt in rows["prompt_id"]]
    return HeldOut(rows, tokens, flat_tokens(fit_rows, False), np.array(row_families)[tokens["row"]], row_families)


def offline_section(head: TokenHead, data: HeldOut) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, bool]]]:
    """Both views of the head and every free predictor, overall and per family, with the predictors' estimates."""
    predictors = {"head": (head_estimates(head, data.tokens), True), **free_predictors(data.fit, data.tokens)}
    return judge(data.tokens, predictors, data.families), predictors


def replay_rules(config: EvalConfig) -> list[str]:
    """Constant K at each of --constant-ks (default: eval's grid up to --max-draft, and --max-draft), vLLM's table and
    the head's planner at the prepacked CPU's token cost, and the oracle."""
    ks = sorted(set(config.constant_ks or {k for k in CONSTANT_KS if k <= config.max_draft} | {config.max_draft}))
    return [*(f"constant_k:{k}" for k in ks), f"lookup_table:{PACKED_CPU_TOKEN_COST}",
            f"lookup_plan:{PACKED_CPU_TOKEN_COST}", ORACLE]


def decoding_section(config: EvalConfig, data: HeldOut) -> dict[str, Any]:
    """Every replay rule on every held-out greedy response (in the labels' order), with per-prompt speedups and
    their geometric means overall and per family."""
    kept = [index for index, response in enumerate(data.rows["target_ids"]) if len(response)]
    rows = data.rows.select(kept).select_columns(["prompt_id", "prompt_ids", "target_ids"])
    rules = replay_rules(config)
    speedups = replay_speedups(((row["prompt_ids"], row["target_ids"]) for row in rows), rules, config.head,
                               config.max_draft)
    families = [data.row_families[index] for index in kept]
    return {"temperature": 0.0, "max_draft": config.max_draft, "token_cost": PACKED_CPU_TOKEN_COST,
            "price": "a round verifying k proposed tokens costs 1 + t·k one-token forwards; the target alone 1 a token",
            "rules": rules, "prompt_ids": list(rows["prompt_id"]), "speedups": speedups,
            "summary": summarise(speedups, families, config.bootstrap, config.seed)}


def evaluate_free(config: EvalConfig) -> list[str]:
    """Judge a free draft's token head and write the report folder (metrics.json, roc.png, reliability.png,
    report.md/.html); returns the verdict's lines. Everything is refused before the labels load."""
    config.validate()
    inputs = check_free_inputs(config)
    out = Path(config.out)
    check_output_folder(out)
    check_output_files(out, [REPORT_FILE, "report.md", "report.html", PLOTS["roc"], PLOTS["reliability"]])
    head = TokenHead.load(config.head, config.draft_kind)
    with folder_lock(out, "eval"):
        data = held_out(config, inputs)
        offline, predictors = offline_section(head, data)
        decoding = decoding_section(config, data) if inputs.replay_refusal is None else None
        report = {"format": FORMAT, "draft_kind": config.draft_kind,
                  "head": {"folder": config.head, **{key: inputs.head.get(key) for key in
                                                     ("head_type", "draft_kind", "target_state_size", "training_data")}},
                  "data": data_section(config, inputs, data), "offline": offline,
                  "calibration": head_calibration(data, predictors["head"][0]),
                  "decoding": decoding, "decoding_skipped": inputs.replay_refusal, "config": config.as_dict()}
        report["verdict"] = verdict_lines(report)
        write_plots(data, predictors, offline, report["calibration"], out)
        write_json_atomic(out / REPORT_FILE, report)
        write_markdown(report_markdown(report), out, "specheads eval: free draft")
    return report["verdict"]


def data_section(config: EvalConfig, inputs: FreeInputs, data: HeldOut) -> dict[str, Any]:
    """metrics.json's `data`: the labels, which rows are held out, where the table was fitted, the families."""
    families, counts = np.unique(np.array(data.row_families), return_counts=True)
    return {"path": config.data, "fingerprint": inputs.manifest["fingerprint"],
            "held_out": "the head's validation split of its training data" if inputs.own_data else "every row",
            "rows": len(data.rows), "prompt_ids": list(data.rows["prompt_id"]), "tokens": int(len(data.tokens["label"])), "fit": inputs.fit,
            "sampling": inputs.manifest["identity"]["sampling"],
            "families": {str(family): int(count) for family, count in zip(families, counts)}}


def head_calibration(data: HeldOut, estimates: np.ndarray) -> dict[str, list[float]]:
    """The head's reliability bins in the conditional view (reached tokens)."""
    bins = calibration_bins(data.tokens["label"], estimates, 10, data.tokens["reach"])
    return {name: [float(value) for value in values] for name, values in bins.items()}


def write_plots(data: HeldOut, predictors: dict[str, tuple[np.ndarray, bool]], offline: dict[str, dict],
                calibration: dict[str, list[float]], out: Path) -> None:
    """ROC of every predictor in the conditional view, and the head's reliability diagram."""
    curves = {name: (data.tokens["label"], values, data.tokens["reach"]) for name, (values, _) in predictors.items()}
    aucs = {name: found["conditional"]["auc"] for name, found in offline["all"].items()}
    predictor_roc_plot(curves, aucs, out / PLOTS["roc"], "ROC of held-out proposed tokens a decode reaches")
    reliability_plot(calibration, out / PLOTS["reliability"])


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """The head against vLLM's table offline, and the replayed rules' speedups (or why none ran)."""
    found = report["offline"]["all"]
    lines = ["AUC conditional/survival: " + ", ".join(
        f"{name} {values['conditional']['auc']:.3f}/{values['survival']['auc']:.3f}" for name, values in found.items())]
    decoding = report["decoding"]
    if decoding is None:
        return [*lines, f"decoding replay skipped: {report['decoding_skipped']}"]
    summary = decoding["summary"]
    return [*lines, "counted speedup at T = 0 (geometric mean over prompts): " + ", ".join(
        f"{rule} {summary[rule]['all']['speedup']:.3f}x" for rule in decoding["rules"])]


def report_markdown(report: dict[str, Any]) -> str:
    """report.md: the verdict, the offline table per family, the plots."""
    lines = [f"# Free draft ({report['draft_kind']}): token head {report['head']['folder']}", "",
             *(f"- {line}" for line in report["verdict"]), "",
             "| family | predictor | AUC cond. | AUC surv. | ECE cond. | binary KL cond. | tokens |",
             "|---|---|---|---|---|---|---|"]
    for family, found in report["offline"].items():
        for name, values in found.items():
            cond = values["conditional"]
            lines.append(f"| {family} | {name} | {cond['auc']:.3f} | {values['survival']['auc']:.3f} | "
                         f"{cond.get('ece', float('nan')):.3f} | {cond.get('binary_kl', float('nan')):.3f} | "
                         f"{cond['tokens']} |")
    if report["decoding"]:
        lines += ["", "| rule | family | counted speedup | 95 % interval | prompts |", "|---|---|---|---|---|"]
        for rule, families in report["decoding"]["summary"].items():
            lines += [f"| {rule} | {family} | {v['speedup']:.3f} | {v['interval']} | {v['prompts']} |"
                      for family, v in families.items()]
    return "\n".join([*lines, "", f"![ROC]({PLOTS['roc']})", f"![reliability]({PLOTS['reliability']})", ""])
