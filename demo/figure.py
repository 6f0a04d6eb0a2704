"""The demo report's first element: each pair's speedup by rule, with intervals, as one PNG (`speedup.png`).

First the prompt-lookup pair's panel (wall clock on this machine against the target alone, each rule with its
interval over prompts: the pair that pays in wall clock here, as docs/results.md orders them), then a panel per
evaluated head on the demo's self-speculative pair (modelled speedup from counted forwards: each free rule's speedup,
and the head's with its 95 % interval paired against that rule, so that a whisker clear of the rule's square is a
win), and one for the EAGLE-3 pair where `--eagle3` ran (wall clock against the target alone, each rule with its
interval over prompts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from specheads.decoding.rules import BASELINES, DRAFTER_BASELINES  # noqa: E402
from specheads.eval.plots import save  # noqa: E402

FIGURE = "speedup.png"
SHORT = {"constant_k": "constant K", "confidence": "draft confidence", "svip": "SVIP", "adaedl": "AdaEDL",
         "vllm_online": "vLLM online (older)", "vllm_current": "vLLM estimator (merged)", "vllm_margin": "vLLM top-2 margin",
         "vllm_history": "per-request history", "transformers": "transformers' default",
         "transformers_heuristic": "transformers' heuristic", "sglang_adaptive": "SGLang adaptive K",
         "sv_companion": "SV companion", "pmin": "llama.cpp p_min", "dspark_confidence": "DSpark's own head",
         "dspark_confidence_ts": "DSpark's head, T-scaled", "head_cost": "the head's rule read from the costs",
         "transformers:0.4": "transformers' default (0.4)", "constant_k:1": "constant K = 1",
         "constant_k:8": "fixed K = 8 (dev-tuned)", "lookup_table": "vLLM's online table",
         "lookup_plan": "the token head's rule"}
"""Each rule's name on the figure (the report's tables and text name them in full)."""
HEAD, RULE = "#c0392b", "#34495e"


@dataclass
class Row:
    """One rule on a panel: its speedup, and an interval drawn as a whisker (`around`: the value it is drawn around,
    where that is not the rule's own speedup)."""

    label: str
    value: float
    interval: tuple[float, float] | None = None
    around: float | None = None
    head: bool = False


@dataclass
class Panel:
    """One pair (and, on the self-speculative pair, one evaluated head): its rows and how to read them."""

    title: str
    axis: str
    rows: list[Row] = field(default_factory=list)


def rule_label(rule: str, threshold: float | None) -> str:
    """`constant K = 3`, `draft confidence (0.2)`."""
    name = SHORT.get(rule, rule)
    if threshold is None:
        return name
    return f"{name} = {threshold:g}" if rule == "constant_k" else f"{name} ({threshold:g})"


def head_panel(title: str, decoding: dict[str, Any]) -> Panel | None:
    """A head's panel on the self-speculative pair: the head, its rule read from the costs, and every free rule it was
    decoded beside; None where the head's own policy was not decoded."""
    mine = decoding.get("modelled_speedup")
    if mine is None:
        return None
    learned = "the head" if decoding["policy"] == "head" else "the verifier"
    panel = Panel(f"self-speculative pair: {title}",
                  f"modelled speedup over the target alone (t_draft/t_target = {decoding['t_draft_over_t_target']:g}); "
                  f"◆ {learned}, its 95 % interval paired against each rule",
                  [Row(f"{learned} ({decoding['threshold']:g})", mine, head=True)])
    if "head_cost_speedup" in decoding:
        panel.rows.append(Row(SHORT["head_cost"], decoding["head_cost_speedup"], head=True))
    rules = []
    for rule in (*BASELINES, *DRAFTER_BASELINES):
        if f"{rule}_speedup" not in decoding:
            continue
        theirs, ci = decoding[f"{rule}_speedup"], decoding.get(f"gain_vs_{rule}_ci")
        interval = (theirs * (1 + ci[0]), theirs * (1 + ci[1])) if ci else None
        rules.append(Row(rule_label(rule, decoding.get(f"{rule}_threshold")), theirs, interval, around=mine))
    panel.rows += sorted(rules, key=lambda row: -row.value)  # the strongest rule next to the head
    return panel


def eagle3_panel(result: dict[str, Any]) -> Panel:
    """The EAGLE-3 pair's panel: each rule's wall-clock speedup over the target alone with its interval over prompts."""
    panel = Panel(f"EAGLE-3 pair: wall clock, B = 1, {result['prompts']} prompts × {result['max_new_tokens']} tokens",
                  f"speedup over the target alone ({result['target_alone_tokens_per_s']:.1f} tokens/s here), "
                  "95 % interval over prompts")
    for rule, row in result["rules"].items():
        interval = row.get("speedup_interval")
        label = SHORT.get(rule, SHORT.get(rule.partition(":")[0], rule))
        panel.rows.append(Row(label, row["speedup"], (1 + interval[0], 1 + interval[1]) if interval else None,
                              head=rule.startswith("head")))
    return panel


def lookup_panel(result: dict[str, Any]) -> Panel:
    """The prompt-lookup pair's panel: each rule's wall-clock speedup over the target alone with its interval over
    prompts (geometric means), and on how many prompts its tokens are the target alone's."""
    n = result["prompts"]
    panel = Panel(f"prompt-lookup pair (no draft model): wall clock, B = 1, T = {result['temperature']:g}, {n} prompts × "
                  f"{result['max_new_tokens']} tokens, one thread, prepacked weights",
                  f"speedup over the target alone ({result['target_alone_tokens_per_s']:.1f} tokens/s here), "
                  "95 % interval over prompts")
    for rule, row in result["rules"].items():
        label = SHORT.get(rule, SHORT.get(rule.partition(":")[0], rule))
        panel.rows.append(Row(f"{label}; target's tokens {row['same_as_target']}/{n}", row["speedup"],
                              tuple(row["interval"]) if row["interval"] else None, head=rule.startswith("lookup_plan")))
    return panel


def panels(summary: dict[str, Any]) -> list[Panel]:
    """Every panel the demo's figures allow: the prompt-lookup pair's first, then the self-speculative pair's heads,
    then the EAGLE-3 pair's."""
    found = [lookup_panel(summary["lookup"])] if summary.get("lookup") else []
    found += [head_panel(figures["title"], figures["decoding"]) for figures in summary["heads"].values()
             if figures.get("decoding")]
    if summary.get("eagle3"):
        found.append(eagle3_panel(summary["eagle3"]))
    return [panel for panel in found if panel is not None and panel.rows]


def draw(panel: Panel, axis: plt.Axes) -> None:
    """One panel: rules top to bottom, a square at each rule's speedup, whiskers for the intervals, 1× marked."""
    for y, row in enumerate(reversed(panel.rows)):
        colour = HEAD if row.head else RULE
        if row.interval:
            centre = row.value if row.around is None else row.around
            axis.errorbar([centre], [y], xerr=[[centre - row.interval[0]], [row.interval[1] - centre]], fmt="D",
                          color=HEAD if row.around is not None else colour, capsize=3, markersize=5)
        axis.plot([row.value], [y], "s", color=colour, markersize=7)
        axis.annotate(f"{row.value:.3f}×", (row.value, y), textcoords="offset points", xytext=(0, 7), ha="center",
                      fontsize=7, color=colour)
    axis.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axis.annotate("target alone", (1.0, len(panel.rows) - 0.45), fontsize=7, color="grey", ha="left")
    axis.set_yticks(range(len(panel.rows)), [row.label for row in reversed(panel.rows)], fontsize=8)
    axis.set_ylim(-0.7, len(panel.rows) - 0.3)
    axis.set_title(panel.title, fontsize=9, loc="left")
    axis.set_xlabel(panel.axis, fontsize=7.5)
    axis.grid(axis="x", alpha=0.3)


def write_figure(summary: dict[str, Any], folder: Path) -> str | None:
    """Draw every panel into `folder/speedup.png`; returns the file's name, or None where no pair decoded."""
    found = panels(summary)
    if not found:
        return None
    heights = [0.45 * len(panel.rows) + 1.1 for panel in found]
    figure, axes = plt.subplots(len(found), 1, figsize=(8, sum(heights)), squeeze=False,
                                gridspec_kw={"height_ratios": heights})
    for panel, axis in zip(found, axes[:, 0]):
        draw(panel, axis)
    figure.tight_layout()
    save(figure, folder / FIGURE)
    return FIGURE
