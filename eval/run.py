"""`specheads eval`: offline metrics, decoding runs and the report for one head on one labelled dataset."""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specheads.artifacts.checkpoint import TrainedHead, load_trained
from specheads.artifacts.report_file import REPORT_FILE, EvaluatedHead, Report
from specheads.dataset.datamodule import AcceptanceDataModule
from specheads.dataset.prompts import encode_prompt, load_prompts, prompt_digest, prompt_token_limit
from specheads.dataset.store import read_manifest
from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.companion import Companion, forward_cost, head_forward_cost
from specheads.decoding.cost_table import PRESET_NAMES, CostTable, read_cost_table
from specheads.decoding.costs import COUNTED, ServingCosts, measure_cost_curve, measure_head_curve
from specheads.decoding.drafters import DRAFTER_KINDS, head_draft_refusal, load_feature_draft
from specheads.decoding.engine import check_decodable_head
from specheads.decoding.features import FeatureDraft, draft_block, draft_candidate_cost, refuse_for_draft
from specheads.decoding.prompt_cache import PromptCache
from specheads.decoding.rules import BASELINES, DRAFTER_BASELINES, RULES
from specheads.eval.companion import sv_companion_scores
from specheads.eval.config import COST_RULES, MEASURED, EvalConfig
from specheads.eval.journal import JOURNAL_FILE, RunJournal, discard_empty_journal, open_journal
from specheads.eval.lookup import free_draft_refusal
from specheads.eval.offline import (
    TokenTable,
    calibration_table,
    collect_tokens,
    cumulative_calibration,
    drafter_temperatures,
    offline_metrics,
    sprinter_distance,
    sprinter_operating_points,
)
from specheads.eval.plots import (
    PLOTS,
    acceptance_length_plot,
    cumulative_reliability_plot,
    pareto_plot,
    reliability_plot,
    roc_plot,
    serving_plot,
)
from specheads.eval.report import verdict, write_report
from specheads.eval.reuse import companion_context, decoding_context, load_reusable
from specheads.eval.serving import (
    NOT_SERVED,
    PLANNED_BY_HEAD,
    LiveRun,
    best_per_batch_size,
    decode_live,
    serving_table,
    serving_views,
)
from specheads.eval.sweep import (
    SAMPLE_SUFFIX,
    DecodePrompt,
    RunKey,
    RunRecord,
    Setting,
    aggregate,
    check_tree_pair,
    decoded_settings,
    default_settings,
    grid_edges,
    head_free,
    is_tree,
    measure_costs,
    paired_gain_interval,
    prompt_group,
    records_as_dicts,
    run_sweep,
    sample_prompt_id,
    signal_thresholds,
    tree_section,
    tree_settings,
    tune,
)
from specheads.eval.tuned import EarlierTuning, given_tuning, load_tuning
from specheads.heads import STOP_PURPOSES
from specheads.heads.loading import STOP_RULE, VERIFY_RULE, DecisionRule, cost_rule_head_refusal
from specheads.heads.roles import CHAIN_HEADS, EXPECTED_ACCEPTANCE, VERIFIER
from specheads.model_outputs.sampling import SamplingTransform
from specheads.model_outputs.states import describe_state
from specheads.pair.drafters import labelled_by_drafter
from specheads.pair.models import (
    ModelPair,
    ModelSpec,
    context_length,
    load_model,
    load_pair,
    load_tokenizer,
    stop_token_ids,
    without_layers,
)
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import check_output_files, check_output_folder, write_json_atomic
from specheads.plumbing.lock import folder_lock
from specheads.plumbing.text import count

MODEL_KEYS = ("target", "draft", "tokenizer_hash", "chat_template_hash", "draft_hidden_size")
TRANSFORM_KEYS = ("temperature", "top_k", "top_p")

BASELINE_POLICIES = (*BASELINES, *DRAFTER_BASELINES)
FREE_BATCH_POLICIES = ("smartspec", "dcut", "vllm_adaptive", "vllm_current_adaptive", "vllm_margin_adaptive",
                       "vllm_history_adaptive", "dspark_adaptive", "dspark_adaptive_ts")
"""The serving table's batch rules that read no head (their value is the largest K)."""
LABELS = {"stop": "accept = min(1, p/q)",
          "expect": "accept = min(1, p/q) of the drafted candidate (the head trains on α = Σ min(p, q) at every position)"}



def identity_differences(trained: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Names of the identity fields that differ (the sampling transform compared field by field)."""
    names = [k for k in sorted(set(trained) | set(found)) if k != "sampling" and trained.get(k) != found.get(k)]
    sampling_trained, sampling_found = trained.get("sampling") or {}, found.get("sampling") or {}
    names += [f"sampling.{k}" for k in TRANSFORM_KEYS if sampling_trained.get(k) != sampling_found.get(k)]
    return names


def check_data(trained: TrainedHead, manifest: dict[str, Any], path: str, allow_other_data: bool) -> None:
    """Refuse data that does not match the head's training data, naming what differs."""
    found_size = int(manifest["identity"]["draft_hidden_size"])
    if found_size != trained.head.hidden_size:
        raise UsageError(f"{path} was labelled with a draft of hidden size {found_size} but the head reads "
                         f"{trained.head.hidden_size}; evaluate it on data from its own draft")
    found_layer = manifest["identity"].get("state_layer")
    if found_layer != trained.head.state_layer:
        raise UsageError(f"{path} stores the draft state {describe_state(found_layer)} but the head reads the state "
                         f"{describe_state(trained.head.state_layer)}; evaluate it on data made with "
                         f"`specheads gen --state_layer {trained.head.state_layer or 'null'}`")
    if trained.data_fingerprint is None or manifest["fingerprint"] == trained.data_fingerprint:
        return
    differs = identity_differences(trained.data_identity or {}, manifest["identity"]) or ["unknown fields"]
    model_level = [name for name in differs if name.split(".")[0] in MODEL_KEYS or name.startswith("sampling.")]
    if allow_other_data and not model_level:
        return
    what = ", ".join(differs)
    hint = ("models and sampling must match the head's" if allow_other_data and model_level
            else "pass --allow-other-data to evaluate other prompts of the same models and sampling")
    raise UsageError(f"{path} (fingerprint {manifest['fingerprint']}) does not match the head's training data "
                     f"(fingerprint {trained.data_fingerprint}): differs in {what}; {hint}")


@dataclass
class LeftOut:
    """The decode prompts left out: how many the head trained on, and those too long for the models' context."""

    seen_in_training: int = 0
    too_long: list[tuple[str, int]] = field(default_factory=list)  # (prompt id, tokens)
    limit: int = 0

    def too_long_line(self, context: int, max_new_tokens: int) -> str | None:
        """The line saying which prompts were skipped as too long, or None."""
        if not self.too_long:
            return None
        first, tokens = self.too_long[0]
        return (f"skipped {count(len(self.too_long), 'decode prompt')} too long for the models' context "
                f"(over {self.limit} tokens: {context} positions minus --max-new-tokens {max_new_tokens}; first "
                f"{first!r}, {tokens:,} tokens); shorten them, or lower --max-new-tokens, to decode them")


def held_out_prompts(config: EvalConfig, manifest: dict[str, Any], trained_on: set[str],
                     tokenizer: Any, max_context: int) -> tuple[list[DecodePrompt], LeftOut]:
    """The decode prompts (alternately dev and test; all test when the thresholds were tuned elsewhere) and those left
    out: the head trained on them (`trained_on`: `prompt_digest`s; with `unseen_prompts_only`, every prompt of the
    data), or they leave no room in the models' context (`max_context` positions) for `config.max_new_tokens`, the
    limit gen's `long_prompts` policy applies. They come from `config.decode_prompts`, else from the evaluated data's
    prompt source. Each test prompt's further samples (`config.test_samples`) follow them all."""
    if config.decode_prompts:
        prompts = load_prompts(config.decode_prompts, column=config.decode_prompts_column,
                               column_flag="--decode-prompts-column")
    else:
        source = manifest["config"]
        prompts = load_prompts(source["prompts"], source["prompts_split"], source["prompts_column"])
    left_out = LeftOut(limit=prompt_token_limit(max_context, config.max_new_tokens))
    chosen = []
    for prompt in prompts:
        if prompt_group(prompt.id) != prompt.id:
            raise UsageError(f"decode prompt id {prompt.id!r} ends like the id of a prompt's further sample "
                             f"(`<id>{SAMPLE_SUFFIX}<n>`, eval --test-samples); rename it")
        ids = tuple(encode_prompt(tokenizer, prompt))
        if prompt_digest(ids) in trained_on:
            left_out.seen_in_training += 1
            continue
        if len(ids) > left_out.limit:
            left_out.too_long.append((prompt.id, len(ids)))
            continue
        if len(chosen) < config.num_decode_prompts:
            split = "dev" if len(chosen) % 2 == 0 and config.tunes_here else "test"
            chosen.append(DecodePrompt(prompt.id, ids, split))
    samples = [DecodePrompt(sample_prompt_id(p.prompt_id, sample), p.ids, p.split)
               for sample in range(1, config.test_samples) for p in chosen if p.split == "test"]
    return chosen + samples, left_out


def held_out_data(config: EvalConfig, trained: TrainedHead, manifest: dict[str, Any]) -> tuple[AcceptanceDataModule, set[str]]:
    """The evaluated data split into the prompts the head trained on and the held-out rest, and the trained-on
    prompts. A head records its training prompts; one trained before specheads did so is split by its seed and
    fraction, which names its held-out prompts only on its own training data."""
    data = AcceptanceDataModule(config.data, val_fraction=trained.split["val_fraction"],
                                split_seed=trained.split["split_seed"])
    if trained.used_prompts is not None:
        data.split_by_trained_prompts(trained.used_prompts)
        return data, trained.used_prompts
    if trained.data_fingerprint is not None and manifest["fingerprint"] != trained.data_fingerprint:
        raise UsageError(f"{trained.source} does not record the prompts it trained on (an older specheads made it), so "
                         f"the held-out prompts of other data such as {config.data} cannot be told; evaluate it on its "
                         "own training data, or train it again")
    data.setup()
    return data, set(data.prompt_digests("train"))


@dataclass
class Decoding:
    """Everything the decoding runs produced."""

    section: dict[str, Any]
    records: list[Any]
    tuned_threshold: float | None
    context: dict[str, Any]
    journal: RunJournal


def decoding_device(name: str) -> torch.device:
    """`auto`: the first GPU when there is one, else the CPU; otherwise the named device (checked)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name} asked for but torch sees no GPU; use --device cpu (or auto)")
    return device


def place(model: torch.nn.Module, device: torch.device) -> None:
    """Move an unsplit model to the decoding device; a model accelerate spread over devices (`device_map`: its
    `hf_device_map`) stays where it was loaded, its hooks moving activations between the parts."""
    if not getattr(model, "hf_device_map", None):
        model.to(device)


def within_tv_budget(dev: list[dict[str, Any]], table: TokenTable, max_tv: float) -> list[dict[str, Any]]:
    """The dev rows without the SPRINTER thresholds whose distance from the target (`sprinter_distance`, on the
    held-out tokens) exceeds `max_tv`; each SPRINTER row is marked `within_tv_budget` for the report."""
    for row in dev:
        if row["policy"] == "sprinter":
            row["within_tv_budget"] = bool(sprinter_distance(table, row["threshold"]) <= max_tv)
    return [row for row in dev if row.get("within_tv_budget", True)]


def tune_on_dev(dev: list[dict[str, Any]], table: TokenTable, purpose: str,
                max_tv: float) -> tuple[dict[str, float], dict[str, str]]:
    """Per policy, the dev-tuned threshold (a verifier's within the TV budget: it trades quality for speed), and the
    policies tuned at an end of their grid, judged on the whole grid: the end of what the budget allowed is not an
    end of the grid (the budget, not the grid, stops the search there)."""
    allowed = within_tv_budget(dev, table, max_tv) if purpose == "verify" else dev
    tuned = {policy: row["threshold"] for policy, row in tune(allowed).items()}
    return tuned, grid_edges(dev, tuned)


@dataclass
class Checked:
    """What the checks before any model loads settled: the evaluated head's identity (its weights digested once),
    the --serving-costs tables as read (each file read and hashed once), the thresholds --fixed-thresholds gives, and
    the expected-acceptance head the verify budget plans with (or why it is left out) with its digest."""

    head: EvaluatedHead
    tables: dict[str, CostTable] = field(default_factory=dict)  # by --serving-costs name (`serving_tables`)
    tuning: EarlierTuning | None = None
    budget_head: Any = None
    budget_digest: str | None = None
    budget_left_out: dict[str, str] = field(default_factory=dict)
    table_notes: dict[str, list[str]] = field(default_factory=dict)  # per --serving-costs file (`cost_table_notes`)
    head_left_out: str | None = None  # why the rules reading the head are not decoded (`head_rules_left_out`)


def serving_tables(config: EvalConfig) -> dict[str, CostTable]:
    """Each --serving-costs table or preset the serving table prices with, read once by its name (a bad one refused
    in one line before the head or any model loads)."""
    if not config.serving_batch_sizes:
        return {}
    return {name: read_cost_table(name, "--serving-costs") for name in config.serving_cost_sources if name != MEASURED}


def check_before_models(config: EvalConfig, trained: TrainedHead, manifest: dict[str, Any],
                        tables: dict[str, CostTable]) -> Checked:
    """Every check of `config` against the head that needs no model: run before the report folder is held, any
    model loads or any forward, so that a bad input is refused at once and leaves nothing behind. `tables`: the
    --serving-costs tables as `serving_tables` read them."""
    checked = Checked(head_identity(trained), tables)
    if config.num_decode_prompts:
        check_decodable_head(trained.head)
        check_drafter_head(config, trained)
        check_drafter_data(config, manifest["identity"]["draft"])
        checked.head_left_out = head_rules_left_out(config, trained, manifest["identity"]["draft"])
    if config.fixed_thresholds:
        checked.tuning = given_tuning(config.fixed_thresholds, own_rule(trained), config.max_draft)
        check_given_rules(config, trained, checked.tuning, "--fixed-thresholds", checked.head_left_out)
    if config.serving_batch_sizes:
        if config.budget_head and checked.head_left_out:
            raise UsageError(f"--budget-head would plan nothing: {checked.head_left_out}; give heads trained on data "
                             f"the --{config.drafter[0]} drafter labelled, or drop --budget-head")
        checked.budget_head, checked.budget_left_out = expected_head(config, trained)
        if checked.budget_head is trained.head:
            checked.budget_digest = checked.head.weights_digest
        elif checked.budget_head is not None:
            checked.budget_digest = checked.budget_head.weights_digest()
        checked.table_notes = cost_table_notes(config, manifest, tables)
        for note in (note for notes in checked.table_notes.values() for note in notes):
            print(f"note: {note}", flush=True)
    return checked


def eval_pair(config: EvalConfig, manifest: dict[str, Any]) -> ModelPair:
    """The data's target and draft; on a feature drafter's data with --eagle3 / --dspark, that drafter is the draft
    (the data's config names no other: its default draft was never run)."""
    source = manifest["config"]
    target_spec = ModelSpec(**source["target"])
    if not (config.drafter and manifest["identity"]["draft"].get("kind")):
        return load_pair(target_spec, ModelSpec(**source["draft"]))
    target = load_model(target_spec)
    kind, folder = config.drafter
    return ModelPair(target, load_feature_draft(kind, folder, target), load_tokenizer(target_spec),
                     target_spec.describe(), f"{DRAFTER_KINDS[kind]} drafter {folder}")


def check_drafter_data(config: EvalConfig, labelled_by: dict[str, Any]) -> None:
    """Refuse decoding a feature drafter's data (`labelled_by`: the manifest's draft identity) without --eagle3 /
    --dspark: its decoding runs draft with that drafter, and the data's config names no other draft."""
    kind = labelled_by.get("kind")
    if kind and not config.drafter:
        raise UsageError(f"{config.data} was labelled with the {DRAFTER_KINDS[kind]} drafter {labelled_by['folder']}, "
                         f"which its decoding runs draft with: give --{kind} {labelled_by['folder']}, or "
                         "--num-decode-prompts 0")


def check_drafter_head(config: EvalConfig, trained: TrainedHead) -> None:
    """Refuse a verifier's eval with --eagle3 / --dspark before any model loads: its rule, SPRINTER, earns no bonus
    token, which a feature drafter's first round needs (`specheads.decoding.features.FeatureDraft.refuse`)."""
    if config.drafter and trained.purpose not in STOP_PURPOSES:
        kind = config.drafter[0]
        raise UsageError(f"--{kind}: a verifier's eval decodes SPRINTER, whose rounds earn no bonus token, which a "
                         f"{DRAFTER_KINDS[kind]} draft's first round needs; evaluate a stop head with --{kind}, or drop it")


def head_rules_left_out(config: EvalConfig, trained: TrainedHead, labelled_by: dict[str, Any]) -> str | None:
    """Why the rules that read the evaluated head are not decoded (None: they are): the head read the state of the
    draft that labelled the data (`labelled_by`, the manifest's draft identity), so with --eagle3 / --dspark they
    decode only where that drafter labelled it (the same files)."""
    if not config.drafter:
        return None
    kind, folder = config.drafter
    if labelled_by_drafter(labelled_by, kind, folder):
        return None
    return (f"the head read the state of the data's draft ({trained.draft}), not the {DRAFTER_KINDS[kind]} drafter's "
            f"({folder}): its rules decode with a head trained on that drafter's data")


def drafter_context(kind: str, folder: str) -> dict[str, Any]:
    """The drafter of the decoding runs as their context records it: its kind, folder and the sha256 of its
    config.json and weights (runs of another drafter are neither reused nor resumed)."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(Path(folder) / name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return {"kind": kind, "folder": str(Path(folder).absolute()), "sha256": digest.hexdigest()}


def own_rule(trained: TrainedHead) -> str:
    """The evaluated head's own rule: the stop rule (`head`) or the SPRINTER loop."""
    return "head" if trained.purpose in STOP_PURPOSES else "sprinter"


def check_given_rules(config: EvalConfig, trained: TrainedHead, tuning: EarlierTuning, given_by: str,
                      head_left_out: str | None) -> None:
    """Refuse given thresholds this eval cannot decode: SV's companion rule without a companion, a tree without its
    floor (`tree_settings` says which; `head_left_out`: why the head's rules are not decoded)."""
    if "sv_companion" in tuning.thresholds and not (config.sv_companion_skip_layers and trained.purpose in STOP_PURPOSES):
        raise UsageError(f"{given_by} names SV's companion rule; give --sv-companion-skip-layers")
    if config.tree_budgets:
        tree_settings(config.tree_budgets, trained.head, trained.purpose, config.cost_ratio, config.tree_floors,
                      tuning.tree_floors, given_by, head_left_out)


def cost_table_notes(config: EvalConfig, manifest: dict[str, Any], tables: dict[str, CostTable]) -> dict[str, list[str]]:
    """Per --serving-costs file (`tables`, by name), what a reader should know of it: that it shadows a roofline preset
    of the same name, or that it was measured for other models than the evaluated pair."""
    source = manifest["config"]
    pair = {"target": ModelSpec(**source["target"]).describe(), "draft": ModelSpec(**source["draft"]).describe()}
    notes: dict[str, list[str]] = {}
    for name in config.serving_cost_sources:
        if name == MEASURED:
            continue
        said = notes.setdefault(name, [])
        if name in PRESET_NAMES and Path(name).exists():
            said.append(f"--serving-costs {name} reads the file {Path(name).absolute()}, which shadows the "
                         "roofline preset of that name; rename or move the file to price with the preset")
        table = tables[name]
        models = table.fields.get("models") if table.source == "measured" else None
        measured = {role: models[role].get("name") for role in pair
                    if isinstance(models, dict) and isinstance(models.get(role), dict)}
        differs = [f"{role} {measured[role]!r} (this pair's: {pair[role]!r})" for role in pair
                   if measured.get(role) not in (None, pair[role])]
        if differs:
            said.append(f"--serving-costs {name} was measured for another {' and '.join(differs)}; its curves "
                         "price this pair's rounds as they are: profile this pair to price them with its own")
    return notes


@dataclass
class DecodePlan:
    """What the decoding runs will be, settled before any forward: the prompts, the context they are decoded in, the
    thresholds taken from elsewhere, the runs reused, and the tree settings."""

    prompts: list[DecodePrompt]
    left_out: LeftOut
    context: dict[str, Any]
    tuning: EarlierTuning | None
    reused: dict[RunKey, RunRecord]
    trees: list[Setting]
    trees_left_out: dict[str, str]
    head_cost: float  # a head forward over one token in draft forwards (`head_forward_cost`): what its scores are counted at
    draft: Any  # what drafts the runs: the data's draft, or the --eagle3 / --dspark drafter
    head_left_out: str | None = None  # why the rules reading the head are not decoded (`head_rules_left_out`)


def plan_decoding(config: EvalConfig, pair: ModelPair, trained: TrainedHead, transform: SamplingTransform,
                  manifest: dict[str, Any], skipped: set[str], device: torch.device, checked: Checked,
                  companion_cost: float | None) -> DecodePlan:
    """The decode prompts and every check that needs the models but no forward: enough prompts, batch sizes the test
    requests fill, --tuned-from and --reuse-runs against this context, the tree settings and the pair's caches.
    `skipped`: the prompts not to decode (`prompt_digest`s); `companion_cost`: SV's companion's, when it decodes."""
    draft = pair.draft
    if config.drafter:  # loaded, and what it cannot draft with refused, before any forward
        draft = pair.draft if isinstance(pair.draft, FeatureDraft) else load_feature_draft(*config.drafter, pair.target)
        for name in ("dspark_confidence", "dspark_adaptive"):  # the _ts forms' temperatures are fitted later
            if {name, f"{name}_ts"} & {*(config.fixed_thresholds or {}), *config.serving_batch_policies}:
                refuse_for_draft(draft, RULES[name], None, None)
    max_context = min(context_length(pair.target), context_length(draft))
    prompts, left_out = held_out_prompts(config, manifest, skipped, pair.tokenizer, max_context)
    too_long = left_out.too_long_line(max_context, config.max_new_tokens)
    if too_long:
        print(too_long, flush=True)
    if len({p.split for p in prompts}) < (2 if config.tunes_here else 1):
        raise UsageError(f"only {len(prompts)} held-out prompt(s) to decode ({left_out.seen_in_training} dropped "
                         f"as training prompts, {len(left_out.too_long)} too long for the context); give "
                         "--decode-prompts or data with more prompts")
    requests = sum(p.split == "test" for p in prompts)
    if config.serving_batch_sizes and max(config.serving_batch_sizes) > requests:
        raise UsageError(f"--serving-batch-sizes {max(config.serving_batch_sizes)} is more than the {requests} test "
                         "requests found to decode, so that batch would never be full; give batch sizes up to "
                         f"{requests}, or raise --test-samples or give more prompts")
    identity = manifest["identity"]
    context = decoding_context({k: identity[k] for k in MODEL_KEYS}, {k: getattr(transform, k) for k in TRANSFORM_KEYS},
                               prompts, config.max_new_tokens, config.max_draft, config.seed, device.type)
    if config.drafter:  # with what each candidate costs after its forward: runs counted without it are not reused
        context["drafter"] = {**drafter_context(*config.drafter),
                              "candidate_cost": round(draft_candidate_cost(draft), 6)}
    head_left_out = checked.head_left_out
    if companion_cost is not None:  # SV's rule decodes with it, and its forwards are counted at its cost
        context["sv_companion"] = companion_context(config.sv_companion_skip_layers, companion_cost)
    head_cost = head_forward_cost(trained.head, pair.draft)
    context["head_forward_cost"] = round(head_cost, 6)  # the head's forwards are counted at it
    reused = load_reusable(config.reuse_runs, context) if config.reuse_runs else {}
    tuning = checked.tuning
    if config.tuned_from:
        tuning = load_tuning(config.tuned_from, checked.head, context, config.cost_ratio)
        check_given_rules(config, trained, tuning, f"{config.tuned_from} (--tuned-from)", head_left_out)
    trees, trees_left_out = tree_settings(
        config.tree_budgets, trained.head, trained.purpose, config.cost_ratio, config.tree_floors,
        tuning.tree_floors if tuning else None, f"{config.tuned_from} (--tuned-from)" if config.tuned_from
        else "--fixed-thresholds", head_left_out) if config.tree_budgets else ([], {})
    if trees:
        check_tree_pair(RoundEngine(pair.target, draft, transform, []), trained.head)
    return DecodePlan(prompts, left_out, context, tuning, reused, trees, trees_left_out, head_cost, draft, head_left_out)


def refuse_unfitted_temperatures(config: EvalConfig, scored: bool, how: str | None) -> None:
    """Refuse, before any decoding run, the rules given by name that read the drafter's confidence through its
    temperatures where none were fitted: the data stores no drafter score (`scored` false), or the head's
    calibration prompts held no drafted token (`how` says which)."""
    named = sorted({name for name, rule in RULES.items() if rule.reads_drafter_temperatures}
                   & {*(config.fixed_thresholds or {}), *config.serving_batch_policies})
    if not named or (scored and how and not how.startswith("not fitted")):
        return
    why = (f"{(how or '').removeprefix('not fitted: ')}; train the head with more calibration prompts" if scored else
           f"{config.data} stores no drafter score to fit them on; label it with `specheads gen --drafter.kind dspark`")
    raise UsageError(f"{' and '.join(named)} read the drafter's confidence through temperatures, which were not "
                     f"fitted: {why}, or drop them")


def decode(config: EvalConfig, pair: ModelPair, trained: TrainedHead, transform: SamplingTransform,
           table: TokenTable, plan: DecodePlan, device: torch.device, checked: Checked,
           companion: Companion | None = None) -> Decoding:
    """Run the sweep (taking head-free runs from `config.reuse_runs` where it has them, and the runs an interrupted
    eval into `config.out` finished: eval.journal), measure the costs, tune on dev (or take the thresholds
    `config.tuned_from` or `config.fixed_thresholds` give), and report on test."""
    learned = own_rule(trained)
    place(pair.target, device)
    place(plan.draft, device)
    trained.head.to(device)
    settings = sweep_settings(config, trained, table, transform, plan, companion is not None)
    journal = open_journal(Path(config.out), plan.context, asdict(checked.head))
    engine, records = run_decodes(config, pair, transform, plan, settings, trained.head, journal, companion)
    chains = [r for r in records if not is_tree(r.policy)]  # the trees have a section of their own
    costs = measure_costs(chains)
    dev = aggregate(chains, "dev", config.cost_ratio, costs["ratio"])
    test = aggregate(chains, "test", config.cost_ratio, costs["ratio"])
    tuned, edges = (dict(plan.tuning.thresholds), {}) if plan.tuning else tune_on_dev(dev, table, trained.purpose,
                                                                                       config.sprinter_max_tv)
    for rule in COST_RULES:  # its one setting, at the stated c, whatever was tuned or given
        if any(s.policy == rule for s in settings):
            tuned[rule] = config.cost_ratio
    for row in test:
        row["tuned"] = tuned.get(row["policy"]) == row["threshold"]
    section = decoding_section(config, plan, records, costs, dev, test, tuned, edges, learned)
    if config.serving_batch_sizes:  # the trees are per-request rules too: served from their runs beside the chains
        served = {**tuned, **{policy: floor for policy, floor in (section.get("trees") or {}).get("tuned_floors", {}).items()
                              if not math.isnan(floor)}}
        section["serving"] = serving_section(config, pair, device, records, served, engine, plan.prompts, trained, checked,
                                             plan.head_left_out)
    return Decoding(section, records, tuned.get(learned), plan.context, journal)


def sweep_settings(config: EvalConfig, trained: TrainedHead, table: TokenTable, transform: SamplingTransform,
                   plan: DecodePlan, with_companion: bool) -> list[Setting]:
    """The settings the sweep decodes: the earlier tuning's, or each rule's grid (the signal rules' thresholds at the
    `config.stop_shares` of the held-out tokens), the cost rules at the stated c, the trees; only the head-free ones
    where the head's rules are left out."""
    prob = table.top1 if transform.greedy else np.exp(table.logq)
    settings = plan.tuning.settings() if plan.tuning else default_settings(
        trained.purpose, signal_thresholds(table.entropy, prob, config.stop_shares, table.top1), config.max_draft,
        config.head_thresholds, config.sprinter_thresholds, config.constant_ks, with_companion,
        drafter_scores=getattr(plan.draft, "scores", False),
        drafter_temperatures=getattr(plan.draft, "score_temperatures", None) is not None)
    if cost_rule_head_refusal(trained.head) is None:  # decoded at the stated c, tuned nowhere; as trained, and calibrated
        settings += [Setting(rule, config.cost_ratio) for rule in COST_RULES]  # while serving
    settings += plan.trees
    if plan.head_left_out:
        settings = head_free(settings, config.max_draft)
    return settings


def run_decodes(config: EvalConfig, pair: ModelPair, transform: SamplingTransform, plan: DecodePlan,
                settings: list[Setting], head: Any, journal: RunJournal,
                companion: Companion | None) -> tuple[RoundEngine, list[RunRecord]]:
    """Decode every setting on every prompt (the runs `journal` holds finished are taken from it, each new one is
    appended to it), the prompts prefilled into the prompt cache first; the engine and the runs."""
    finished = resumable(journal, decoded_settings(settings, config.max_draft), plan.prompts)
    prompt_cache = PromptCache(config.prompt_cache_bytes) if config.prompt_cache_bytes else None
    engine = RoundEngine(pair.target, plan.draft, transform, stop_token_ids(pair.target, pair.tokenizer), companion,
                         prompt_cache)
    engine.store_prompts([list(p.ids) for p in plan.prompts], config.decode_batch_size)  # no setting times the prefill
    records = run_sweep(engine, plan.prompts, settings, head, config.max_new_tokens, config.max_draft,
                        config.seed, config.progress, plan.reused, config.decode_batch_size, finished, journal.append)
    return engine, records


def decoding_section(config: EvalConfig, plan: DecodePlan, records: list[RunRecord], costs: dict[str, Any],
                     dev: list[dict[str, Any]], test: list[dict[str, Any]], tuned: dict[str, float],
                     edges: dict[str, str], learned: str) -> dict[str, Any]:
    """metrics.json's `decoding` (but its serving table): the costs, the prompts, the tuned thresholds and the paired
    gain intervals of the `learned` rule and of the cost rules over the others, each rule's row on dev and test, the
    drafter, the trees."""
    prompts, tuning = plan.prompts, plan.tuning
    intervals = {baseline: paired_gain_interval(records, Setting(learned, tuned[learned]), Setting(baseline, tuned[baseline]),
                                                config.cost_ratio, config.bootstrap, config.seed)
                 for baseline in BASELINE_POLICIES if learned in tuned and baseline in tuned}
    cost_rule_intervals = {rule: {other: paired_gain_interval(records, Setting(rule, config.cost_ratio),
                                                              Setting(other, tuned[other]), config.cost_ratio,
                                                              config.bootstrap, config.seed)
                                  for other in (learned, *COST_RULES, *BASELINE_POLICIES)
                                  if rule in tuned and other in tuned and other != rule}
                           for rule in COST_RULES}
    section = {"t_draft_over_t_target": config.cost_ratio, "head_forward_cost": plan.head_cost, "speedup_from": COUNTED,
               "measured_costs": costs,
               "prompts": {"dev": sum(p.split == "dev" for p in prompts),
                           "test": len({prompt_group(p.prompt_id) for p in prompts if p.split == "test"})},
               "samples_per_test_prompt": config.test_samples,
               "max_new_tokens": config.max_new_tokens, "max_draft": config.max_draft, "tuned_thresholds": tuned,
               "gain_intervals": intervals, "head_cost_gain_intervals": cost_rule_intervals["head_cost"],
               "head_cost_online_gain_intervals": cost_rule_intervals["head_cost_online"], "policies": test,
               "dev_policies": dev,
               "reused_runs": {"from": config.reuse_runs, "count": sum(r.reused for r in records if r.policy != "oracle")},
               "tuned_from": tuning.as_dict() if tuning else None,
               "tuned_at_grid_edge": edges}
    if config.drafter:
        section["drafter"] = plan.context["drafter"]
    if config.drafter or plan.head_left_out:
        section["head_left_out"] = plan.head_left_out
    if plan.trees:
        section["trees"] = tree_section(records, config.tree_budgets, tuned, config.cost_ratio, costs["ratio"],
                                        tuning.tree_floors if tuning else None, config.bootstrap, config.seed,
                                        plan.trees_left_out, config.tree_floors)
    return section


def resumable(journal: RunJournal, settings: list[Setting], prompts: list[DecodePrompt]) -> dict[RunKey, RunRecord]:
    """The runs of this sweep (`settings` as decoded, on `prompts`) that an interrupted eval already finished, said in
    one line (after the line saying why any others of the journal were dropped)."""
    if journal.note:
        print(journal.note, flush=True)
    wanted = {(s.policy, s.threshold, p.prompt_id) for s in settings for p in prompts}
    finished = {key: record for key, record in journal.finished.items() if key in wanted}
    if finished:
        print(f"resuming: {len(finished)} of {len(wanted)} decoding runs already finished in {journal.path}", flush=True)
    return finished


def serving_section(config: EvalConfig, pair: ModelPair, device: torch.device, records: list[Any],
                    tuned: dict[str, float], engine: RoundEngine, prompts: list[DecodePrompt],
                    trained: TrainedHead, checked: Checked, head_left_out: str | None = None) -> dict[str, Any]:
    """Each policy at its tuned threshold, and the batch policies (the verify budget, SmartSpec's K), serving
    `config.serving_batch_sizes` requests at a time (eval.serving), priced with the models' cost curves (given in
    `config.serving_costs` or measured here) and with the draft at `config.cost_ratio` × the target; a policy that
    reads a head pays its forwards (its curve where one was timed for that head, else its weights' share of the
    draft's). `head_left_out`: why the batch rules that read a head are left out (a feature drafter drafts)."""
    budget_head = None if checked.budget_head is None or head_left_out else checked.budget_head.to(device).eval()
    left_out = dict(checked.budget_left_out) if not head_left_out else {"budget": head_left_out}
    heads = {"evaluated": trained.head, **({"budget": budget_head} if budget_head is not None else {})}
    digests = {"evaluated": checked.head.weights_digest, "budget": checked.budget_digest}  # each computed once an eval
    sources, curves, measured_heads = serving_costs(config, pair, device, engine, checked, heads, digests)
    batch_policies = served_batch_policies(config, engine, budget_head is not None, left_out)
    test = [(number, prompt) for number, prompt in enumerate(prompts) if prompt.split == "test"]

    def live(policy: str, threshold: float, size: int, view: ServingCosts) -> LiveRun:
        return decode_live(engine, [list(p.ids) for _, p in test], [config.seed * 1_000_003 + number for number, _ in test],
                           make_policy(policy, threshold, config.max_draft), config.max_new_tokens, size, view,
                           budget_head if policy in PLANNED_BY_HEAD else None)

    views = serving_views(sources, config.cost_ratio)
    digest_of = {policy: digests["budget" if policy in PLANNED_BY_HEAD else "evaluated"]
                 for policy in (*tuned, *batch_policies) if policy not in PLANNED_BY_HEAD or "budget" in heads}
    head_curves = {(policy, view): timed[digest] for view, timed in measured_heads.items()
                   for policy, digest in digest_of.items() if digest in timed}
    rows = serving_table(records, tuned, list(config.serving_batch_sizes), views, live, batch_policies,
                         resamples=config.bootstrap, seed=config.seed, queue=[p.prompt_id for _, p in test],
                         head_curves=head_curves)
    left_out.update({policy: why for policy, why in NOT_SERVED.items() if policy in tuned})
    return {"batch_sizes": list(config.serving_batch_sizes), "views": list(views), "requests": len(test),
            "samples_per_test_prompt": config.test_samples,
            "cost_curves": curves, "scaled_draft_ratio": config.cost_ratio,
            "head_forward_costs": {role: head_forward_cost(head, pair.draft) for role, head in heads.items()},
            "budget": {"floor": config.budget_floor, "max_draft": config.max_draft,
                       "head": None if budget_head is None else (config.budget_head or trained.source),
                       "weights_digest": None if budget_head is None else checked.budget_digest},
            "rows": rows, "best": best_per_batch_size(rows), "left_out": left_out}


def serving_costs(config: EvalConfig, pair: ModelPair, device: torch.device, engine: RoundEngine, checked: Checked,
                  heads: dict[str, Any], digests: dict[str, str | None]) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """The serving table's cost views, one per `config.serving_cost_sources` (the curves measured here, or a cost
    table's): (view, the costs at a batch size, whether measured) each; the curves each view used, for the report; and
    per view, the `heads`' curves timed there, by weights digest (`digests`, by role)."""
    sources, curves, measured_heads = [], {}, {}  # measured_heads: view -> the heads' curves measured there, by digest
    for name in config.serving_cost_sources:
        if name == MEASURED:
            measured = ServingCosts(measure_cost_curve(engine.draft), measure_cost_curve(pair.target))
            sources.append((MEASURED, lambda size, measured=measured: measured, True))
            measured_heads[MEASURED] = {digests[role]: measure_head_curve(head) for role, head in heads.items()}
            curves[MEASURED] = {"draft": measured.draft.as_dict(), "target": measured.target.as_dict(),
                                "source": f"measured on {device_name(device)}", "modelled": False}
        else:
            table = checked.tables[name]
            view = table.view if table.view not in curves else f"{table.view} ({name})"
            sources.append((view, table.at_batch_size, table.source != "roofline"))
            measured_heads[view] = {table.head_digest: table.costs.head} if table.head_digest else {}
            curves[view] = {**curves_used(table.costs, most_served_tokens(config, draft_block(engine.draft))),
                            "source": table.describe(),
                            "modelled": table.modelled, "per_batch_size": table.source == "roofline" and name in PRESET_NAMES,
                            **table_file(table), **({"notes": checked.table_notes[name]}
                                                   if checked.table_notes.get(name) else {})}
    for view, timed in measured_heads.items():
        if timed:
            curves[view]["heads"] = {digest: curve.as_dict() for digest, curve in timed.items()}
    return sources, curves, measured_heads


def served_batch_policies(config: EvalConfig, engine: RoundEngine, has_budget_head: bool,
                          left_out: dict[str, str]) -> dict[str, float]:
    """The batch rules the serving table decodes live, each at its value, in the order --serving-batch-policies names
    them (a DSpark drafter's adaptive rules added where it scores): the rules fed a head's products only with a
    budget head (`has_budget_head`), else noted in `left_out` beside the budget rule."""
    # SmartSpec and the goodput planner's free signals read no head; their value is the largest K
    batch_policies: dict[str, float] = {}
    named = [*config.serving_batch_policies, *(["dspark_adaptive"] if getattr(engine.draft, "scores", False) else []),
             *(["dspark_adaptive_ts"] if getattr(engine.draft, "score_temperatures", None) is not None else [])]
    for policy in dict.fromkeys(named):
        if policy in FREE_BATCH_POLICIES:
            batch_policies[policy] = float(config.max_draft)
        elif not has_budget_head:  # the budget and dcut's planner fed the head's products need an expected head
            if "budget" in left_out:
                left_out[policy] = left_out["budget"]
        else:
            batch_policies[policy] = config.budget_floor if policy == "budget" else float(config.max_draft)
    return batch_policies


def most_served_tokens(config: EvalConfig, block: int | None = None) -> int:
    """The most tokens one forward of the serving table can hold: the largest batch, each row reading at most as
    many tokens as a round drafts (K_max, a tree's N) or a row generates (a draft catching up after rounds without
    drafting), plus one, and a block drafter's block beside its catch-up."""
    per_row = max(config.max_draft, config.max_new_tokens, *(config.tree_budgets or [])) + (block or 0)
    return max(config.serving_batch_sizes or [1]) * (per_row + 1)


def table_file(table: CostTable) -> dict[str, Any]:
    """What identifies a --serving-costs file in the report (its path and the sha256 of the bytes read); the name
    alone for a preset's."""
    if table.sha256 is None:
        return {"preset": table.path}
    return {"path": str(Path(table.path).absolute()), "sha256": table.sha256}


def curves_used(costs: ServingCosts, most_tokens: int) -> dict[str, Any]:
    """The draft's and target's curves up to the first point at or beyond `most_tokens` (all the serving table's
    forwards read), the rest dropped: they price every forward the same, and a table of millions of points is not
    copied into the report; each curve's full point count is kept beside."""
    used: dict[str, Any] = {}
    for role, curve in (("draft", costs.draft), ("target", costs.target)):
        keep = max(bisect.bisect_left(curve.tokens, most_tokens) + 1, 2)
        used[role] = {"tokens": list(curve.tokens[:keep]), "seconds": list(curve.seconds[:keep])}
        if keep < len(curve.tokens):
            used[role]["points_in_table"] = len(curve.tokens)
    return used


def expected_head(config: EvalConfig, trained: TrainedHead) -> tuple[Any, dict[str, str]]:
    """The expected-acceptance head the verify budget plans with: the evaluated head when it is one, else
    `config.budget_head`; without one the budget is left out of the serving table, with the reason."""
    if trained.purpose == "expect":
        return trained.head, {}
    if not config.budget_head:
        return None, {"budget": "no expected-acceptance head to plan with: give --budget-head (a head trained with "
                                "configs/train/expected-acceptance.yaml)"}
    other = load_trained(config.budget_head)
    other.check_role((EXPECTED_ACCEPTANCE,), "--budget-head")  # it must decide before the draw to stay exact
    if config.drafter:  # the drafter's files decide, as they do for the evaluated head (`head_rules_left_out`)
        refusal = head_draft_refusal(other.draft, other.data_identity, config.drafter)
        if refusal:
            raise UsageError(f"--budget-head {config.budget_head}: {refusal}")
    if (not config.drafter and other.draft != trained.draft) or other.sampling != trained.sampling:
        raise UsageError(f"--budget-head {config.budget_head} was trained for draft {other.draft!r} with sampling "
                         f"{other.sampling}, not the evaluated head's {trained.draft!r} with {trained.sampling}; "
                         "give a head trained on data from the same pair and sampling")
    return other.head, {}


def device_name(device: torch.device) -> str:
    """The device in words (a GPU's model name)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def decision_rule(trained: TrainedHead, threshold: float | None, config: EvalConfig) -> DecisionRule:
    """The rule export carries: the dev-tuned threshold, or the untuned default when no decoding ran; a threshold given
    by --fixed-thresholds was tuned for another head, so it is marked untuned."""
    if threshold is None:
        return DecisionRule.untuned(trained.purpose)
    tuned = not config.fixed_thresholds
    if trained.purpose in STOP_PURPOSES:
        return DecisionRule(STOP_RULE, threshold, tuned=tuned, max_draft=config.max_draft, cost_ratio=config.cost_ratio)
    return DecisionRule(VERIFY_RULE, threshold, tuned=tuned, cost_ratio=config.cost_ratio)


def head_identity(trained: TrainedHead) -> EvaluatedHead:
    """What identifies the evaluated head in the report."""
    return EvaluatedHead(source=trained.source, config=trained.head.config, reads=trained.reads, tau=trained.tau,
                         draft=trained.draft, target=trained.target, data_fingerprint=trained.data_fingerprint,
                         parameters=trained.head.num_parameters(), weights_digest=trained.head.weights_digest())


def evaluate(config: EvalConfig) -> Report:
    """Evaluate and write the report folder (the tuned rule lives in its metrics.json; nothing is written into the
    checkpoint); returns the report. One eval at a time writes a folder (`specheads.plumbing.lock`)."""
    config.validate()
    refusal = free_draft_refusal(config.head, config.data)
    if refusal:
        raise UsageError(refusal)
    tables = serving_tables(config)
    check_output_folder(Path(config.out))
    check_output_files(Path(config.out), [REPORT_FILE, "report.md", "report.html", "runs.json", JOURNAL_FILE,
                                          *PLOTS.values()])
    device = decoding_device(config.device)
    manifest = read_manifest(Path(config.data))
    if manifest is None or not manifest.get("complete"):
        raise UsageError(f"{config.data} holds no finished labelled dataset (no complete manifest.json); "
                         f"run `specheads gen --out {config.data}` first")
    trained = load_trained(config.head)
    trained.check_role((*CHAIN_HEADS, VERIFIER), "specheads eval --head")
    check_data(trained, manifest, config.data, config.allow_other_data)
    checked = check_before_models(config, trained, manifest, tables)
    with folder_lock(Path(config.out), "eval"):
        try:
            return evaluate_locked(config, device, manifest, trained, checked)
        except UsageError:  # refused: leave nothing behind (the lock then removes a folder it made)
            discard_empty_journal(Path(config.out))
            raise


def evaluate_locked(config: EvalConfig, device: torch.device, manifest: dict[str, Any], trained: TrainedHead,
                    checked: Checked) -> Report:
    """`evaluate` once the report folder is held: the decoding runs are planned (and refused where they cannot
    run) before the first forward."""
    data, trained_on = held_out_data(config, trained, manifest)
    need_models = (config.num_decode_prompts > 0 or data.mode == "online" or trained.head.candidate_embedding_size
                   or config.sv_companion_skip_layers)
    pair = eval_pair(config, manifest) if need_models else None
    transform = SamplingTransform(**{k: manifest["identity"]["sampling"][k] for k in TRANSFORM_KEYS})
    companion_model = (without_layers(pair.target, list(config.sv_companion_skip_layers))
                       if config.sv_companion_skip_layers else None)
    decodes_companion = companion_model is not None and trained.purpose in STOP_PURPOSES  # also decoded, as a stop rule
    companion_cost = forward_cost(companion_model, pair.draft) if companion_model is not None else None
    plan = None
    if config.num_decode_prompts:
        skipped = (trained_on | {digest for split in data.splits for digest in data.prompt_digests(split)}
                   if config.unseen_prompts_only else trained_on)
        plan = plan_decoding(config, pair, trained, transform, manifest, skipped, device, checked,
                             companion_cost if decodes_companion else None)
    table = collect_tokens(trained, data, pair.draft if pair else None)
    if not len(table.label):
        raise UsageError(f"the held-out prompts of {config.data} hold no labelled token for this head; "
                         "evaluate on data with more prompts or draft positions")
    temperatures = None
    if table.drafter_score is not None:  # a DSpark drafter's own confidence head: scored with and without them
        table.drafter_temperatures, temperatures = drafter_temperatures(trained, data, pair.draft if pair else None,
                                                                        config.max_draft)
    if plan is not None and hasattr(plan.draft, "score_temperatures"):  # decoded as SGLang applies them, beside raw
        plan.draft.score_temperatures = table.drafter_temperatures
        refuse_unfitted_temperatures(config, table.drafter_score is not None, temperatures)
    companion = None
    if companion_model is not None:
        table.sv_companion, bins = sv_companion_scores(pair.draft, companion_model, transform, data.splits["train"],
                                                       data.splits["val"], table.row, table.position)
        companion = Companion(companion_model, bins, companion_cost) if decodes_companion else None
    scores = table.scores(config.seed)
    offline = offline_metrics(table, config.bootstrap, config.seed, scores=scores)
    data_section = held_out_section(config, manifest, table, data, trained, temperatures)
    decoding = None
    if plan is not None:
        decoding = decode(config, pair, trained, transform, table, plan, device, checked, companion)
        decoding.section["prompts_dropped_as_seen_in_training"] = plan.left_out.seen_in_training
        decoding.section["prompts_skipped_as_too_long"] = [prompt_id for prompt_id, _ in plan.left_out.too_long]
        if companion is not None:
            decoding.section["sv_companion_cost"] = companion.cost  # its forwards in draft forwards, as counted
    rule = decision_rule(trained, decoding.tuned_threshold if decoding else None, config)
    cumulative = (cumulative_calibration(table, trained.head.calibration, config.max_draft, resamples=config.bootstrap,
                                         seed=config.seed, scores=scores)
                  if trained.purpose in STOP_PURPOSES else None)
    report = Report(head=checked.head, data=data_section, offline=offline["signals"], cumulative=cumulative,
                    offline_comparison=offline_comparison(offline), calibration=calibration_table(table),
                    config=config.as_dict(), decision_rule=rule, decoding=decoding.section if decoding else None,
                    sprinter=sprinter_operating_points(table, rule.threshold) if trained.purpose == "verify" else None)
    report.verdict = verdict(report)
    write_outputs(report, table, decoding, cumulative, config)
    return report


def held_out_section(config: EvalConfig, manifest: dict[str, Any], table: TokenTable, data: AcceptanceDataModule,
                     trained: TrainedHead, temperatures: str | None) -> dict[str, Any]:
    """metrics.json's `data`: the held-out tokens scored, their label, the DSpark drafter's fitted temperatures
    (`temperatures`: how they were fitted, None where the data stores no drafter score), and the note of data labelled
    before gen stored `top2` (also printed)."""
    section = {"path": config.data, "fingerprint": manifest["fingerprint"], "tokens": int(len(table.label)),
               "prompts": table.prompts, "mean_label": float(table.label.mean()),
               "held_out": "the prompts the head did not train (or calibrate) on",
               "prompts_trained_on": len(set(data.splits["train"]["prompt_id"])),
               "label": LABELS.get(trained.purpose, f"1[q/p <= {trained.tau}]")}
    if temperatures is not None:
        section["dspark_temperatures"] = {
            "temperatures": None if table.drafter_temperatures is None else
            [1 / scale for scale in table.drafter_temperatures.scale], "how": temperatures}
    if table.margin_note:  # data labelled before gen stored `top2`
        section["margin_note"] = table.margin_note
        print(f"Note: {table.margin_note}.", flush=True)
    return section


def write_outputs(report: Report, table: TokenTable, decoding: Decoding | None, cumulative: list[dict[str, Any]] | None,
                  config: EvalConfig) -> None:
    """Write the report folder: the plots, runs.json (removed where nothing was decoded), metrics.json and the
    report's pages; the decode's journal goes once they are written."""
    out = Path(config.out)
    report.plots = write_plots(report, table, decoding, cumulative, out, config)
    if decoding:
        write_json_atomic(out / "runs.json", {"context": decoding.context, "runs": records_as_dicts(decoding.records)})
    else:  # an earlier eval's runs are not this report's: --reuse-runs and --tuned-from must not find them
        (out / "runs.json").unlink(missing_ok=True)
    report.write(out)
    write_report(report, out)
    if decoding:
        decoding.journal.remove()


def offline_comparison(offline: dict[str, Any]) -> dict[str, Any]:
    """metrics.json's `offline_comparison`: the head against the best training-free signal, under `top2_margin`
    against the top-2 margin fitted online where the data stores `top2`, and under `dspark_confidence` against a DSpark
    drafter's own confidence head where the data stores its score."""
    margin, drafter = offline.get("head_vs_top2_margin"), offline.get("head_vs_dspark_confidence")
    return {**offline["head_vs_best_baseline"], **({"top2_margin": margin} if margin else {}),
            **({"dspark_confidence": drafter} if drafter else {})}


def write_plots(report: Report, table: TokenTable, decoding: Decoding | None, cumulative: list[dict[str, Any]] | None,
                out: Path, config: EvalConfig) -> dict[str, str]:
    """Draw this run's plots into `out` and remove the plot files an earlier run left there that this one does not
    draw (a report lists only its own); the plots drawn, by name."""
    drawings = {"roc": lambda path: roc_plot(table, report.offline, path, config.seed),
                "reliability": lambda path: reliability_plot(report.calibration, path)}
    if cumulative:
        drawings["cumulative_reliability"] = lambda path: cumulative_reliability_plot(cumulative, path)
    if decoding:
        drawings["pareto"] = lambda path: pareto_plot(decoding.section["policies"], path, config.cost_ratio)
        if decoding.section.get("serving"):
            drawings["serving"] = lambda path: serving_plot(decoding.section["serving"]["rows"], path)
        drawings["acceptance_lengths"] = lambda path: acceptance_length_plot(accepted_lengths(decoding), path)
    out.mkdir(parents=True, exist_ok=True)
    for name, file in PLOTS.items():
        if name in drawings:
            drawings[name](out / file)
        else:
            (out / file).unlink(missing_ok=True)
    return {name: file for name, file in PLOTS.items() if name in drawings}


def accepted_lengths(decoding: Decoding) -> dict[str, list[int]]:
    """Accepted tokens per round on test prompts, for each policy at its tuned threshold."""
    tuned = decoding.section["tuned_thresholds"]
    lengths: dict[str, list[int]] = {}
    for record in decoding.records:
        if record.split == "test" and tuned.get(record.policy) == record.threshold and record.policy != "oracle":
            lengths.setdefault(f"{record.policy} @ {record.threshold:g}", []).extend(record.accepted_per_round)
    return lengths
