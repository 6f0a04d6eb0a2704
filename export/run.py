"""Write a head folder (model.safetensors, config.json, README.md, roc.png and, for a stop head, custom_generate/)
atomically, and push it to the Hub."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from specheads import __version__
from specheads.artifacts.checkpoint import TrainedHead, load_trained
from specheads.artifacts.report_file import Report, read_report
from specheads.export.card import render_card
from specheads.export.config import ExportConfig
from specheads.export.dspark import check_destination, export_into_dspark, read_checkpoint
from specheads.export.safety import check_empty, check_finite, check_not_holding, export_lock, regular_file
from specheads.heads import AcceptanceHead
from specheads.heads.loading import (
    COST_RULE,
    HEAD_FORMAT,
    HEAD_FORMAT_VERSION,
    STOP_RULE,
    STOP_RULES,
    DecisionRule,
    cost_rule_refusal,
    worst_calibrated,
)
from specheads.heads.roles import CHAIN_HEADS, VERIFIER
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_folder, replace_folder, usual_permissions

TRAINING_KEYS = ("head", "head_args", "extra_features", "candidate_embedding", "w_acc", "w_rej", "tau", "contexts",
                 "optimizer", "lr", "weight_decay", "warmup_ratio")


def report_of_this_head(folder: Path, trained: TrainedHead) -> tuple[Report, Path | None]:
    """The eval report in `folder` and its ROC plot, refused unless it evaluated this very head (weights and kind)."""
    report = read_report(folder)
    evaluated = report.head
    kind, mine = (evaluated.head_type, evaluated.reads), (trained.head.config.get("head_type"), trained.reads)
    if kind != mine:
        raise UsageError(f"the report in {folder} evaluated a {kind[0]} head (reads {kind[1]}), but {trained.source} is a "
                         f"{mine[0]} head (reads {mine[1]}); give the report of this head")
    digest = trained.head.weights_digest()
    if evaluated.weights_digest != digest:
        found = f"weights {evaluated.weights_digest}" if evaluated.weights_digest else "no weights digest (an older report)"
        raise UsageError(f"the report in {folder} evaluated another head ({found}, from {evaluated.source}) than "
                         f"{trained.source} (weights {digest}); give the report of this head, or run "
                         f"`specheads eval --head {trained.source}` for one")
    return report, regular_file(folder / "roc.png", "--report")


def default_rule(trained: TrainedHead, report: Report) -> tuple[DecisionRule, dict[str, Any]]:
    """The rule the head carries, and why (config.json's `rule_choice`): for a stop head whose calibration eval found
    good enough (`cost_rule_refusal`), the rule read from the costs at the report's c; otherwise the report's rule
    (a tuned threshold)."""
    rule = report.decision_rule
    if rule.rule != STOP_RULE:
        return rule, {"rule": rule.rule, "why": "a SPRINTER verifier's rule"}
    max_draft = int(report.config.get("max_draft") or rule.max_draft or 8)  # the positions eval measured calibration at
    refusal = cost_rule_refusal(trained.head, report.cumulative, max_draft)
    tuned = rule.threshold if rule.tuned else None
    if refusal:
        return rule, {"rule": rule.rule, "why": f"a tuned threshold: {refusal}", "tuned_threshold": tuned}
    cost_ratio = float(rule.cost_ratio or report.config.get("cost_ratio") or 0.2)
    worst = worst_calibrated(report.cumulative, max_draft)["ece"]
    return (DecisionRule(COST_RULE, cost_ratio, tuned=False, max_draft=max_draft, cost_ratio=cost_ratio),
            {"rule": COST_RULE, "why": f"its calibrated survival product is within ECE {worst:.3f} of the realised one "
                                       f"at every round position up to {max_draft} on held-out prompts, so the rule "
                                       "is read from the costs, tuned nowhere", "tuned_threshold": tuned})


def head_config(trained: TrainedHead, rule: DecisionRule, metrics: dict[str, Any]) -> dict[str, Any]:
    """config.json: the head's constructor arguments plus the export contract's fields (docs/decoding-core.md)."""
    identity = trained.data_identity or {}
    config = {**trained.head.config, "format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION,
              "specheads_version": __version__, "depth": trained.head.config.get("depth", 0),
              "draft": {"name": trained.draft, "weights": identity.get("draft")},
              "target": {"name": trained.target, "weights": identity.get("target")},
              "tokenizer_hash": identity.get("tokenizer_hash"), "sampling": trained.sampling,
              "decision_rule": rule.as_dict(),
              "training_data": {"fingerprint": trained.data_fingerprint, "identity": identity, "split": trained.split},
              "metrics": metrics, "training": {k: trained.training.get(k) for k in TRAINING_KEYS if k in trained.training}}
    if trained.purpose == "verify":
        config["tau"] = trained.tau
        config["contexts"] = trained.contexts
    return config


def commands(config: ExportConfig, trained: TrainedHead, report: Report | None) -> list[str]:
    """The commands that made the head, as far as the checkpoint and report know them."""
    lines = []
    run_config = Path(trained.source).parent.parent / "config.yaml"
    if run_config.is_file():
        lines.append(f"specheads train fit --config {run_config}")
    if report:
        c = report.config
        lines.append(f"specheads eval --head {c.get('head')} --data {c.get('data')} --out {c.get('out')} "
                     f"--num-decode-prompts {c.get('num_decode_prompts')} --cost-ratio {c.get('cost_ratio')}")
    lines.append(f"specheads export --ckpt {config.ckpt} --out {config.out}" + (f" --report {config.report}" if config.report else "")
                 + (f" --weights-dtype {config.weights_dtype}" if config.weights_dtype != "float32" else ""))
    return lines


def custom_generate_files(head: AcceptanceHead, rule: DecisionRule) -> dict[str, str]:
    """The custom_generate/ files that let `target.generate(custom_generate="org/head", trust_remote_code=True,
    draft=draft)` run the head's rule (`hub_generate.py`, copied verbatim, and its requirements), for a head
    `speculative_generate` decodes with: a stop rule, reading the draft's states only; none for the others."""
    if rule.rule not in STOP_RULES or getattr(head, "target_state_size", 0):
        return {}
    return {"custom_generate/generate.py": files("specheads.export").joinpath("hub_generate.py").read_text(),
            "custom_generate/requirements.txt": f"specheads>={__version__}\n"}


def stored_head(head: AcceptanceHead, weights_dtype: str) -> AcceptanceHead:
    """`head` as model.safetensors stores it: its weight matrices in `weights_dtype` (a copy when that is not the
    head's own), vectors and input statistics as they are."""
    dtype = getattr(torch, weights_dtype)
    if all(parameter.dtype == dtype for parameter in head.parameters() if parameter.ndim >= 2):
        return head
    stored = copy.deepcopy(head)
    for parameter in stored.parameters():
        if parameter.ndim >= 2:
            parameter.data = parameter.data.to(dtype)
    return stored


def write_folder(out: Path, trained: TrainedHead, config_json: dict[str, Any], card_commands: list[str],
                 roc: Path | None, overwrite: bool, code: dict[str, str], weights_dtype: str = "float32") -> None:
    """Build the folder beside `out` (with the `custom_generate_files` in `code`, the weight matrices stored in
    `weights_dtype`, refused when not finite so) and move it into place in one rename (nothing half-written), holding
    `out`'s export lock throughout; the folder being built is removed however the export ends."""
    stored = stored_head(trained.head, weights_dtype)
    check_finite(stored.state_dict(), f"the head as --weights-dtype {weights_dtype} stores it")
    with export_lock(out):
        check_empty(out, overwrite)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            stored.save_pretrained(staging, config=config_json)
            if roc is not None:
                shutil.copyfile(roc, staging / "roc.png")
            for name, text in code.items():
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                (staging / name).write_text(text)
            render_card(config_json, card_commands, roc is not None, bool(code)).save(staging / "README.md")
            usual_permissions(staging)
            replace_folder(staging, out)
        finally:
            if staging.exists():
                shutil.rmtree(staging)


def push(out: Path, repo_id: str, private: bool, revision: str | None, message: str) -> str:
    """Upload the folder with huggingface_hub (token from the environment or the standard login; never printed)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id=repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(out), revision=revision, commit_message=message)
    except HfHubHTTPError as error:
        raise UsageError(f"pushing to {repo_id} failed: {str(error).splitlines()[0]}; check the repo id and that "
                         "HF_TOKEN (or `hf auth login`) gives write access") from None
    except Exception as error:  # no network, HF_HUB_OFFLINE=1, a proxy: httpx and huggingface_hub raise many types
        reason = " ".join(str(error).split())[:200]
        raise UsageError(f"pushing to {repo_id} failed ({type(error).__name__}: {reason}); the head is written in {out}: "
                         "run the same command again once the Hub is reachable (unset HF_HUB_OFFLINE)") from None
    return str(getattr(info, "commit_url", None) or repo_id)


def already_exported(out: Path, trained: TrainedHead, config_json: dict[str, Any], code: dict[str, str],
                     weights_dtype: str = "float32") -> bool:
    """True when `out` holds exactly this export already (same config.json, the same weights as `weights_dtype` stores
    them, the same custom_generate/ files and no others): a push can be retried without writing the folder again."""
    from specheads.heads.loading import load_head

    try:
        same_config = json.loads((out / "config.json").read_text()) == json.loads(json.dumps(config_json))
        held = {p.relative_to(out).as_posix() for p in (out / "custom_generate").rglob("*") if p.is_file()}
        same_code = held == set(code) and all((out / name).read_text() == text for name, text in code.items())
        stored = stored_head(trained.head, weights_dtype).weights_digest()
        return same_config and same_code and load_head(str(out))[0].weights_digest() == stored
    except (OSError, ValueError, UsageError):
        return False


def export_dspark(config: ExportConfig) -> dict[str, Any]:
    """`--into-dspark`: the head written into a copy of a DSpark checkpoint (`export.dspark`), every input checked
    before anything is written; returns the provenance written beside the weights."""
    out, checkpoint = check_destination(config), read_checkpoint(config.into_dspark)
    trained = load_trained(config.ckpt)
    report = report_of_this_head(Path(config.report), trained)[0] if config.report else None
    metrics = report.headline() if report else dict(trained.evaluation or {})
    written = export_into_dspark(config, out, checkpoint, trained, metrics)
    if config.push_to_hub:
        written["pushed_to"] = push(out, config.push_to_hub, config.private, config.revision,
                                    f"specheads confidence head from {Path(config.ckpt).name}")
    return written


def export(config: ExportConfig) -> dict[str, Any]:
    """Export the checkpoint's head; returns config.json's content (with `--into-dspark`: `export_dspark`'s)."""
    if config.into_dspark:
        return export_dspark(config)
    check_output_folder(Path(config.out), replaced=True)  # the new folder is renamed into its place
    check_not_holding(Path(config.out), [("--ckpt", config.ckpt), ("--report", config.report)])
    trained = load_trained(config.ckpt)
    trained.check_role((*CHAIN_HEADS, VERIFIER), "specheads export (a head folder carries a chain or SPRINTER rule)")
    report, roc = report_of_this_head(Path(config.report), trained) if config.report else (None, None)
    choice = None
    if report:
        (rule, choice), metrics = default_rule(trained, report), report.headline()
    else:  # an exported folder keeps its own rule and headline; a checkpoint without a report is untuned
        rule, metrics = trained.rule, dict(trained.evaluation or {})
    config_json = head_config(trained, rule, metrics)
    if choice is not None:
        config_json["rule_choice"] = choice
    if config.weights_dtype != "float32":
        config_json["weights_dtype"] = config.weights_dtype
    out, code = Path(config.out), custom_generate_files(trained.head, rule)
    if not (config.push_to_hub and not config.overwrite and already_exported(out, trained, config_json, code,
                                                                                    config.weights_dtype)):
        write_folder(out, trained, config_json, commands(config, trained, report), roc, config.overwrite, code,
                     config.weights_dtype)
    if config.push_to_hub:
        config_json["pushed_to"] = push(out, config.push_to_hub, config.private, config.revision,
                                        f"specheads export of {Path(config.ckpt).name}")
    return config_json
