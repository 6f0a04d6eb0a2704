"""metrics.json, typed: what `specheads eval` writes, and the one reader that tuning, export, the model card and
the demo all use.

The top level and the parts other commands act on are typed (the evaluated head, the decision rule); the
metric tables stay plain mappings of numbers, as `eval.offline` and `eval.sweep` make them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from specheads.heads.loading import DecisionRule
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

REPORT_FILE = "metrics.json"


@dataclass(frozen=True)
class EvaluatedHead:
    """Which head a report evaluated: where it came from, its architecture, training data and weights."""

    source: str
    config: dict[str, Any]
    reads: str
    tau: float
    draft: str | None
    target: str | None
    data_fingerprint: str | None
    parameters: int
    weights_digest: str | None = None  # reports of older versions do not record it

    @property
    def head_type(self) -> str | None:
        """The registry name of the head (`specdecpp_resnet`, `sprinter_linear`)."""
        return self.config.get("head_type")


@dataclass
class Report:
    """The whole of metrics.json."""

    head: EvaluatedHead
    data: dict[str, Any]
    offline: dict[str, dict[str, Any]]
    offline_comparison: dict[str, Any]
    calibration: dict[str, list[float]]
    config: dict[str, Any]
    decision_rule: DecisionRule
    verdict: dict[str, Any] = field(default_factory=dict)
    decoding: dict[str, Any] | None = None
    sprinter: dict[str, Any] | None = None
    cumulative: list[dict[str, Any]] | None = None  # a stop head's Π â per round position (eval.offline)
    plots: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """metrics.json's content (sections a run did not make are left out)."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def write(self, folder: Path) -> None:
        """Write metrics.json into `folder` (atomic)."""
        write_json_atomic(folder / REPORT_FILE, self.as_dict())

    @classmethod
    def from_dict(cls, content: dict[str, Any], where: str) -> Report:
        """The typed report of metrics.json's content; a one-line refusal for anything that is not one."""
        try:
            head = EvaluatedHead(**{f.name: content["head"][f.name] for f in fields(EvaluatedHead)
                                    if f.name in content["head"]})
            values = {f.name: content[f.name] for f in fields(cls) if f.name in content}
            values.update(head=head, decision_rule=DecisionRule(**content["decision_rule"]))
            return cls(**values)
        except (KeyError, TypeError, AttributeError) as error:
            raise UsageError(f"{where} is not a `specheads eval` report (missing or malformed {error}); give the folder "
                             "`specheads eval --out` wrote, or evaluate again") from None

    def tuned_row(self, policy: str) -> dict[str, Any] | None:
        """The test row of `policy` at its dev-tuned threshold (None without decoding runs)."""
        return tuned_row(self.decoding or {"policies": []}, policy)

    def headline(self) -> dict[str, Any]:
        """The few numbers a head carries with it: config.json, the model card and the demo summary."""
        head, best = self.offline["head"], self.offline_comparison["baseline"]
        result: dict[str, Any] = {
            "auc": head["auc"], "auc_ci": head["auc_ci"], "binary_kl": head["binary_kl"],
            "binary_kl_constant": self.offline["constant"]["binary_kl"], "best_baseline": best,
            "best_baseline_auc": self.offline[best]["auc"], "auc_margin": self.offline_comparison["auc_margin"],
            "auc_margin_ci": self.offline_comparison["auc_margin_ci"], "data_fingerprint": self.data["fingerprint"],
            "tokens": self.data["tokens"]}
        if self.decoding:
            result["t_draft_over_t_target"] = self.decoding["t_draft_over_t_target"]
            result["head_forward_cost"] = self.decoding.get("head_forward_cost")  # None: counted free (older reports)
            result["speedup_from"] = self.decoding.get("speedup_from", "SpecDec++ Eq. 5.1 (a report from before counted "
                                                                       "speedups; it overstates SPRINTER)")
            learned = self.tuned_row("head") or self.tuned_row("sprinter")
            if learned:
                result["modelled_speedup"] = learned["modelled_speedup"]
            constant = self.tuned_row("constant_k")
            if constant:
                result["modelled_speedup_constant_k"] = constant["modelled_speedup"]
            trees = tree_headline(self.decoding)
            if trees:
                result["tree_drafts"] = trees
            decided = self.verdict.get("decoding", {})
            for key in ("strongest_baseline", "strongest_baseline_speedup", "gain_vs_strongest_baseline",
                        "gain_vs_strongest_baseline_ci"):
                if decided.get(key) is not None:
                    result[key] = decided[key]
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}


def tuned_row(decoding: dict[str, Any], policy: str) -> dict[str, Any] | None:
    """The test row of `policy` at its dev-tuned threshold in a report's decoding section."""
    return next((r for r in decoding["policies"] if r["policy"] == policy and r.get("tuned")), None)


def tree_headline(decoding: dict[str, Any]) -> dict[str, Any] | None:
    """The tree of a report's tree-draft section (`decoding.trees`, eval.sweep.tree_section) with the highest modelled
    speedup on test prompts at its tuned floor or grown by the costs, and its gain over the head's stop rule (or,
    without one, constant K) with the paired interval; None when no tree was decoded."""
    trees = (decoding or {}).get("trees")
    rows = [row for row in (trees or {}).get("policies", []) if row.get("tuned")]
    if not rows:
        return None
    best = max(rows, key=lambda row: row["modelled_speedup"])
    result = {"policy": best["policy"], "values": best["values"], "budget": best["budget"], "growth": best["growth"],
              "threshold": best["threshold"], "modelled_speedup": best["modelled_speedup"],
              "tokens_per_target_call": best["tokens_per_target_call"], "decoded_budgets": trees["budgets"]}
    for against in ("head", "constant_k"):
        gain = next((g for g in trees["gains"] if (g["policy"], g["against"]) == (best["policy"], against)), None)
        if gain is not None:
            result.update(against=against, gain=gain["speedup_gain"], gain_ci=gain["speedup_gain_ci"])
            break
    return result


def read_report(folder: str | Path) -> Report:
    """The report in `folder` (a `specheads eval --out` folder), refused in one line when there is none."""
    path = Path(folder) / REPORT_FILE
    if not path.is_file():
        raise UsageError(f"{folder} holds no {REPORT_FILE}; give the folder `specheads eval --out` wrote")
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"{path} is not readable JSON ({error}); evaluate again") from None
    if not isinstance(content, dict):
        raise UsageError(f"{path} is not a `specheads eval` report; give the folder `specheads eval --out` wrote")
    return Report.from_dict(content, str(path))
