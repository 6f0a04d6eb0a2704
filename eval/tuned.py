"""Taking the thresholds an earlier report tuned on its dev prompts, to confirm them on fresh test prompts.

`specheads eval --tuned-from DIR` decodes each policy only at the threshold DIR's report tuned for it, and
counts every prompt decoded here as a test prompt. Nothing is tuned again, so a new prompt set measures the
tuned rules with all its prompts. Checked against DIR: the same head (its weights), models, sampling,
max_new_tokens, max_draft, cost ratio and the cost the head's forwards are counted at (reports from before they were
counted tuned with the head free); none of DIR's dev prompts may be decoded here. Other seeds and
devices are allowed: they only draw fresh samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specheads.artifacts.report_file import EvaluatedHead, read_report
from specheads.decoding.rules import STOP_POLICIES
from specheads.eval.config import COST_RULES, FIXED_POLICIES, FIXED_TREES
from specheads.eval.reuse import companion_context, saved_runs
from specheads.eval.sweep import FIXED_SETTINGS, Setting, tree_policy
from specheads.plumbing.errors import UsageError

MATCHED_CONTEXT = ("models", "sampling", "max_new_tokens", "max_draft", "accounting")


@dataclass(frozen=True)
class EarlierTuning:
    """The thresholds a report tuned, and on how many dev prompts."""

    report: str | None
    thresholds: dict[str, float]
    dev_prompts: int
    tree_floors: dict[str, float] = field(default_factory=dict)  # tree policy (`tree_head_n8`) or kind -> its floor

    def settings(self) -> list[Setting]:
        """One setting per tuned policy, in the sweep's order."""
        return [Setting(policy, self.thresholds[policy]) for policy in FIXED_POLICIES if policy in self.thresholds]

    def as_dict(self) -> dict[str, Any]:
        """What metrics.json records under `decoding.tuned_from` (`report` None: thresholds given in the config)."""
        return {"report": self.report, "dev_prompts": self.dev_prompts}


def given_tuning(thresholds: dict[str, float], learned: str, max_draft: int) -> EarlierTuning:
    """The thresholds of --fixed-thresholds, tuned elsewhere, as a tuning to decode (none of its dev prompts known),
    refused where they name a rule the evaluated head's eval does not run, or leave out `learned`, its own rule."""
    allowed = set(STOP_POLICIES) - set(COST_RULES) if learned == "head" else {"constant_k", "sprinter"}  # c: --cost-ratio
    trees = {policy: float(value) for policy, value in thresholds.items() if policy in FIXED_TREES}
    thresholds = {policy: value for policy, value in thresholds.items() if policy not in FIXED_TREES}
    wrong = sorted(set(thresholds) - allowed)
    if wrong:
        raise UsageError(f"--fixed-thresholds names {', '.join(wrong)}, which the eval of this head does not decode; "
                         f"use {', '.join(sorted(allowed))}")
    if learned not in thresholds:
        raise UsageError(f"--fixed-thresholds gives no threshold for `{learned}`, the evaluated head's own rule; add one")
    if "oracle" in thresholds and thresholds["oracle"] != max_draft:
        raise UsageError(f"the oracle is read off the constant-K_max runs: give oracle: {max_draft} (--max-draft) in "
                         "--fixed-thresholds, or leave it out")
    if thresholds.get("constant_k", 1) > max_draft:
        raise UsageError(f"--fixed-thresholds gives constant_k {thresholds['constant_k']:g}, above --max-draft {max_draft}")
    return EarlierTuning(None, {policy: float(value) for policy, value in thresholds.items()}, 0, trees)


def head_differences(earlier: dict[str, Any], head: dict[str, Any]) -> list[str]:
    """Why the earlier report's head is not this one: compared by weights where both record a digest (reports
    of older versions do not), else by source path; the architecture and training data always."""
    key = "weights_digest" if earlier.get("weights_digest") and head.get("weights_digest") else "source"
    differs = [name for name in (key, "reads", "data_fingerprint") if earlier.get(name) != head.get(name)]
    if set_fields(earlier.get("config")) != set_fields(head.get("config")):
        differs.insert(1, "config")
    return differs


def set_fields(config: dict[str, Any] | None) -> dict[str, Any]:
    """A head config without its unset (None) fields: a field added to the heads later reads None in configs
    written before it existed."""
    return {name: value for name, value in (config or {}).items() if value is not None}


def load_tuning(folder: str, head: EvaluatedHead, context: dict[str, Any], cost_ratio: float) -> EarlierTuning:
    """The thresholds tuned in the report `folder` for `head` (eval.run.head_identity), refused when that report
    decoded another head or context (`context` as eval.reuse.decoding_context writes it) or tuned on a prompt
    of this context."""
    report = read_report(folder)
    decoding = report.decoding or {}
    if not decoding.get("tuned_thresholds"):
        raise UsageError(f"{folder} holds no tuned thresholds (its eval decoded nothing); give a report that ran "
                         "decoding with --num-decode-prompts")
    if decoding.get("tuned_from"):
        source = decoding["tuned_from"]["report"] or "its config (--fixed-thresholds)"
        raise UsageError(f"{folder} tuned nothing itself: it took its thresholds from {source}; give a report that "
                         "tuned on dev prompts to --tuned-from")
    differs = head_differences(asdict(report.head), asdict(head))
    if differs:
        raise UsageError(f"{folder} tuned its thresholds for another head (differs in {', '.join(differs)}); give a "
                         "report of this head, or drop --tuned-from to tune on dev prompts here")
    earlier, runs = saved_runs(folder, "its tuning", "drop --tuned-from to tune on dev prompts here")
    differs = [name for name in MATCHED_CONTEXT if earlier.get(name) != context[name]]
    if decoding.get("t_draft_over_t_target") != cost_ratio:
        differs.append("cost_ratio")
    if "sv_companion" in decoding["tuned_thresholds"] and "sv_companion" in context:
        then = earlier.get("sv_companion") or companion_context(report.config.get("sv_companion_skip_layers"),
                                                                decoding.get("sv_companion_cost", 1.0))
        if then != context["sv_companion"]:  # reports from before the cost was recorded counted it as 1
            differs.append("SV companion (its layers or the cost its forwards are counted at)")
    if earlier.get("head_forward_cost", 0.0) != context.get("head_forward_cost", 0.0):  # before it: counted free
        differs.append("head forward cost (the draft forwards each head forward is counted at)")
    if differs:
        raise UsageError(f"{folder} tuned with another {', '.join(differs)} than this run; give the same settings, "
                         "or drop --tuned-from to tune on dev prompts here")
    digests = dict(map(tuple, earlier["prompts"]))
    dev_ids = {row["prompt_id"] for row in runs if row["split"] == "dev"}
    dev = {digests[prompt_id] for prompt_id in dev_ids}
    seen = [prompt_id for prompt_id, digest in context["prompts"] if digest in dev]
    if seen:
        raise UsageError(f"{len(seen)} of the prompts to decode (first {seen[0]!r}) tuned the thresholds of {folder}; "
                         "confirm them on prompts that report never tuned on")
    tuned = {policy: float(t) for policy, t in decoding["tuned_thresholds"].items()}
    fixed = {policy: value for policy, value in FIXED_SETTINGS.items() if policy not in tuned}  # added since that report
    trees = decoding.get("trees") or {}
    floors = {policy: float(floor) for policy, floor in (trees.get("tuned_floors") or {}).items()
              if (tree := tree_policy(policy)) is not None and not tree.weighs_costs}  # cost-grown trees: tuned nowhere
    return EarlierTuning(folder, {**fixed, **tuned}, len(dev_ids), floors)
