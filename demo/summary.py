"""The demo's numbers (summary.json), read from each head's report (metrics.json), and the one-screen text."""

from __future__ import annotations

from typing import Any

from specheads.demo.stages import HEADS, Layout, relative
from specheads.eval.report import MIN_TEST_PROMPTS, interval_cell, logprob_difference
from specheads.report_file import REPORT_FILE, Report
from specheads.text import count


def head_summary(report: Report, layout: Layout, head: str) -> dict[str, Any]:
    """One head's figures: its report's headline (the same numbers export puts into config.json), what the demo
    screen adds, and where the files are."""
    result: dict[str, Any] = {
        **report.headline(), "title": HEADS[head], "label": report.data["label"],
        "held_out_tokens": report.data["tokens"], "held_out_prompts": report.data["prompts"],
        "decision_rule": report.decision_rule.as_dict(),
        "metrics": str(layout.report(head) / REPORT_FILE), "report": str(layout.report(head) / "report.html"),
        "exported": str(layout.exported(head)),
    }
    if report.decoding:
        decoding = report.decoding
        result["decoding"] = {**report.verdict["decoding"], "t_draft_over_t_target": decoding["t_draft_over_t_target"],
                              "measured_t_draft_over_t_target": decoding["measured_costs"]["ratio"],
                              "measured_ratio_ci": decoding["measured_costs"].get("ratio_ci"),
                              "measured_ratio_reliable": decoding["measured_costs"].get("reliable", False),
                              "test_prompts": decoding["prompts"]["test"], "max_new_tokens": decoding["max_new_tokens"]}
    if report.sprinter:
        result["tv_distance"] = report.sprinter["tv_distance"]
    return result


def summarise(layout: Layout, manifest: dict[str, Any], reports: dict[str, Report], seconds: dict[str, float],
              commands: list[str], size: str) -> dict[str, Any]:
    """summary.json: the data, each head's figures, where everything is, how long each stage took."""
    counts = manifest["counts"]
    return {
        "size": size, "folder": str(layout.root), "report": str(layout.root / "report.html"),
        "pair": {"target": manifest["target_name"], "draft": manifest["draft_name"],
                 "sampling": manifest["identity"]["sampling"]},
        "data": {"path": str(layout.data), "fingerprint": manifest["fingerprint"], "rows": counts["rows"],
                 "prompts": counts["prompts"], "labelled_tokens": counts["labelled_tokens"],
                 "mean_accept": manifest["mean_accept"]},
        "heads": {head: head_summary(reports[head], layout, head) for head in HEADS},
        "seconds": seconds, "commands": commands,
    }


def duration(seconds: float) -> str:
    """`3m07s`."""
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def signed_interval(interval: list[float] | None) -> str:
    """` [+lo, +hi]` (empty without an interval)."""
    return f" [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else ""


def decoding_line(figures: dict[str, Any]) -> str:
    """The head's decoding result in one line."""
    d = figures.get("decoding")
    if not d:
        return "no decoding runs"
    if "modelled_speedup" not in d:
        return d.get("note", "no decoding run of the learned policy")
    c = f"t_draft/t_target = {d['t_draft_over_t_target']:g}"
    if d["policy"] == "head":
        line = f"modelled speedup {d['modelled_speedup']:.3f}x at h = {d['threshold']:g}"
    else:
        line = (f"{d['tokens_per_target_call']:.2f} tokens/target call, modelled {d['modelled_speedup']:.3f}x "
                f"at τ-threshold {d['threshold']:g}")
    if "constant_k_speedup" in d:
        line += (f" vs best constant K {d['constant_k_speedup']:.3f}x (K = {d['constant_k_threshold']:g}): "
                 f"{d['gain_vs_constant_k'] * 100:+.1f} %" + percent_interval(d.get("gain_vs_constant_k_ci")))
    strongest = d.get("strongest_baseline")
    if strongest and strongest != "constant_k":
        line += (f"; vs the strongest free rule, {strongest} {d['strongest_baseline_speedup']:.3f}x: "
                 f"{d['gain_vs_strongest_baseline'] * 100:+.1f} %" + percent_interval(d.get("gain_vs_strongest_baseline_ci")))
    if "oracle_speedup" in d:
        line += f"; oracle {d['oracle_speedup']:.3f}x"
        if d.get("beat_the_oracle"):
            line += f" (beaten by {', '.join(d['beat_the_oracle'])} on these prompts: chance at this size)"
    if "target_logprob_vs_sd" in d:
        line += f"; target log-likelihood of its text {logprob_difference(d['target_logprob_vs_sd'])}"
    line += f" ({c}, {count(d['test_prompts'], 'test prompt')} x {d['max_new_tokens']} tokens)"
    if d.get("indicative"):
        line += f"; indicative only, not a finding: fewer than {MIN_TEST_PROMPTS} test prompts"
    return line


def percent_interval(interval: list[float] | None) -> str:
    """` [+lo %, +hi %]` of a paired gain interval (empty without one)."""
    return f" [{interval[0] * 100:+.1f}, {interval[1] * 100:+.1f} %]" if interval else ""


def unresolved(figures: dict[str, Any]) -> list[str]:
    """What the demo's data is too small to settle for one head: an AUC margin or a decoding gain whose interval
    includes zero, or decoding on fewer than MIN_TEST_PROMPTS test prompts."""
    open_questions = []
    margin = figures.get("auc_margin_ci")
    if margin is None or margin[0] <= 0 <= margin[1]:
        open_questions.append(f"whether it ranks tokens better than {figures['best_baseline']}")
    d = figures.get("decoding") or {}
    gain = d.get("gain_vs_constant_k_ci")
    if d and (d.get("indicative") or gain is None or gain[0] <= 0 <= gain[1]):
        open_questions.append("whether it decodes faster than the best constant K")
    return open_questions


def scale_lines(summary: dict[str, Any]) -> list[str]:
    """What the figures rest on and, where that is too little to rank the policies, where the larger runs are."""
    lines = []
    for figures in summary["heads"].values():
        questions = unresolved(figures)
        if questions:
            tested = (figures.get("decoding") or {}).get("test_prompts", 0)
            lines.append(f"  scale    {figures['title']}: {figures['held_out_tokens']:,} held-out tokens and "
                         f"{count(tested, 'test prompt')} do not settle {' or '.join(questions)}")
    if lines:
        lines.append("           the demo shows the pipeline working; docs/results.md has the heads' standing on "
                     "larger data and 160 test prompts")
    return lines


def summary_text(summary: dict[str, Any]) -> str:
    """The one-screen summary printed at the end of the demo."""
    data, pair = summary["data"], summary["pair"]
    lines = [f"specheads demo ({summary['size']}) finished in {duration(summary['seconds']['total'])}",
             f"  pair     target {pair['target']}, draft {pair['draft']}, temperature {pair['sampling']['temperature']:g}",
             f"  data     {data['labelled_tokens']:,} labelled tokens, {data['rows']} rows from {data['prompts']} built-in "
             f"prompts (mean acceptance {data['mean_accept']:.3f})  {relative(data['path'])}"]
    for figures in summary["heads"].values():
        lines += [f"  {figures['title']}  ({figures['held_out_tokens']:,} held-out tokens from "
                  f"{count(figures['held_out_prompts'], 'prompt')}, label {figures['label']})",
                  f"    AUC {interval_cell(figures['auc'], figures['auc_ci'])} vs best baseline {figures['best_baseline']} "
                  f"{figures['best_baseline_auc']:.3f}: margin {figures['auc_margin']:+.3f}"
                  f"{signed_interval(figures['auc_margin_ci'])}",
                  f"    binary KL {figures['binary_kl']:.3f} vs constant predictor {figures['binary_kl_constant']:.3f}",
                  f"    {decoding_line(figures)}",
                  f"    exported {relative(figures['exported'])}   report {relative(figures['report'])}"]
    lines += scale_lines(summary)
    stages = " · ".join(f"{key} {duration(value)}" for key, value in summary["seconds"].items() if key != "total")
    lines += [f"  stages   {stages}", f"  report   {relative(summary['report'])}",
              "  load a head: specheads.heads.load_head(folder) (docs/decoding-core.md); the figures are in summary.json"]
    return "\n".join(lines)
