"""The demo's report.md / report.html: a figure of each pair's speedup by rule first, then the summary table, the
commands that ran, and each head's eval report."""

from __future__ import annotations

import re
from typing import Any

from specheads.artifacts.report_file import Report
from specheads.demo.eagle3 import eagle3_lines
from specheads.demo.figure import write_figure
from specheads.demo.lookup import lookup_lines
from specheads.demo.stages import TITLES, Layout
from specheads.demo.summary import decoding_line, duration, serving_line
from specheads.eval.report import fmt, interval_cell, report_markdown, write_markdown


def summary_table(summary: dict[str, Any]) -> list[str]:
    """Both heads side by side."""
    heads = summary["heads"]
    rows = [("AUC on held-out tokens [95 % CI]", lambda f: interval_cell(f["auc"], f["auc_ci"])),
            ("best training-free signal (AUC)", lambda f: f"{f['best_baseline']} ({fmt(f['best_baseline_auc'])})"),
            ("AUC margin over it", lambda f: f"{f['auc_margin']:+.3f}"),
            ("binary KL (constant predictor)", lambda f: f"{fmt(f['binary_kl'])} ({fmt(f['binary_kl_constant'])})"),
            ("decoding (test prompts)", decoding_line),
            ("serving", lambda f: serving_line(f) or "–"),
            ("decision rule", lambda f: f"`{f['decision_rule']['rule']}` at {f['decision_rule']['threshold']:g}"
                                        f"{'' if f['decision_rule']['tuned'] else ' (untuned)'}"),
            ("exported to", lambda f: f"`{f['exported']}`" if f["exported"].startswith("load_head")
             else f"`heads/{f['exported'].rsplit('/', 1)[-1]}`")]
    lines = ["| | " + " | ".join(f["title"] for f in heads.values()) + " |", "|---|" + "---|" * len(heads)]
    lines += [f"| {name} | " + " | ".join(cell(f) for f in heads.values()) + " |" for name, cell in rows]
    return lines


def figure_lines(summary: dict[str, Any], figure: str | None) -> list[str]:
    """The report's first element: the speedup figure and what it shows (or why there is none)."""
    if figure is None:
        return ["No pair decoded, so there is no speedup figure: the heads' offline figures are below.", ""]
    scale = " The quick demo is a smoke run, too small to rank anything." if summary["size"] == "quick" else ""
    return [f"![Speedup by rule for each pair the demo ran]({figure})", "",
            "Speedup by rule for each pair the demo ran, on test prompts nothing was tuned on: a square is a rule's "
            "speedup; a whisker is a 95 % interval (on the self-speculative pair, the head's, paired against that "
            f"rule: wholly right of the rule's square, the head wins; wholly left, it loses).{scale}", ""]


PAIRS = {"lookup": "prompt-lookup pair", "EAGLE-3": "EAGLE-3 pair"}
"""The screen's short label of each wall-clock line's pair, and the report's name for it."""
WALL_CLOCK_KEYS = ("lookup_wall_clock", "eagle3_wall_clock")
"""The seconds of the pairs decoded in wall clock after the stages (no `specheads` command of their own)."""


def wall_clock_section(summary: dict[str, Any]) -> list[str]:
    """The pairs decoded in wall clock on this machine, as the demo's screen gives them: the prompt-lookup pair, and
    the EAGLE-3 pair or how to add it."""
    lines = [*(lookup_lines(summary["lookup"]) if summary.get("lookup") else []), *eagle3_lines(summary.get("eagle3"))]
    named = [re.sub(r"^(lookup|EAGLE-3) +", lambda pair: f"**{PAIRS[pair.group(1)]}**: ", line.strip()) for line in lines]
    return ["## Wall clock on this machine", "", *[f"- {line}" for line in named], ""]


def demo_markdown(summary: dict[str, Any], reports: dict[str, Report], figure: str | None = None) -> str:
    """The whole demo report as markdown: the figure (`figure`, a file in the demo folder) first, then the summary
    table, the commands and each head's report (plots linked into each head's eval folder)."""
    data, pair = summary["data"], summary["pair"]
    lines = ["# specheads demo", "", *figure_lines(summary, figure),
             f"Target `{pair['target']}`, draft `{pair['draft']}`, temperature {pair['sampling']['temperature']:g}. "
             f"{data['labelled_tokens']:,} labelled tokens in {data['rows']} rows from {data['prompts']} built-in prompts "
             f"(mean acceptance {data['mean_accept']:.3f}; fingerprint `{data['fingerprint']}`). Finished in "
             f"{duration(summary['seconds']['total'])}.", "", *summary_table(summary), "", *wall_clock_section(summary),
             "## What ran", "", "Each stage is a `specheads` command; run one alone to change it.", ""]
    keys = [key for key in summary["seconds"] if key not in ("total", *WALL_CLOCK_KEYS)]
    lines += [f"{n}. `{command}` ({duration(summary['seconds'][key])})"
              for n, (key, command) in enumerate(zip(keys, summary["commands"]), 1)]
    lines.append("")
    for head in reports:
        lines += [f"## {TITLES[head]}", "", report_markdown(reports[head], plot_dir=f"eval/{head}/", depth=3)]
    return "\n".join(lines)


def write_demo_report(summary: dict[str, Any], reports: dict[str, Report], layout: Layout) -> None:
    """speedup.png, report.md and report.html in the demo folder."""
    figure = write_figure(summary, layout.root)
    write_markdown(demo_markdown(summary, reports, figure), layout.root, "specheads demo report")
