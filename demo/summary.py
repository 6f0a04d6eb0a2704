"""The demo's numbers (summary.json), read from each head's report (metrics.json), and the one-screen text."""

from __future__ import annotations

from typing import Any

from specheads.artifacts.report_file import REPORT_FILE, Report
from specheads.decoding.rules import BASELINES as DECODING_BASELINES
from specheads.demo.stages import SHIPPED, SHIPPED_HEAD, TITLES, Layout, relative
from specheads.eval.report import MIN_TEST_PROMPTS, cost_words, interval_cell, logprob_difference
from specheads.eval.serving import PLANNED_BY_HEAD
from specheads.plumbing.text import count


def head_summary(report: Report, layout: Layout, head: str) -> dict[str, Any]:
    """One head's figures: its report's headline (the same numbers export puts into config.json), what the demo
    screen adds, and where the files are."""
    result: dict[str, Any] = {
        **report.headline(), "title": TITLES[head], "label": report.data["label"],
        "held_out_tokens": report.data["tokens"], "held_out_prompts": report.data["prompts"],
        "decision_rule": report.decision_rule.as_dict(),
        "metrics": str(layout.report(head) / REPORT_FILE), "report": str(layout.report(head) / "report.html"),
        "exported": f'load_head("{SHIPPED_HEAD}")' if head == SHIPPED else str(layout.exported(head)),
    }
    if report.decoding:
        decoding = report.decoding
        result["decoding"] = {**report.verdict["decoding"], "t_draft_over_t_target": decoding["t_draft_over_t_target"],
                              "head_forward_cost": decoding.get("head_forward_cost"),
                              "measured_t_draft_over_t_target": decoding["measured_costs"]["ratio"],
                              "measured_ratio_ci": decoding["measured_costs"].get("ratio_ci"),
                              "measured_ratio_reliable": decoding["measured_costs"].get("reliable", False),
                              "test_prompts": decoding["prompts"]["test"], "max_new_tokens": decoding["max_new_tokens"]}
        if decoding.get("serving"):
            result["serving"] = serving_summary(decoding["serving"], decoding["t_draft_over_t_target"])
    if report.sprinter:
        result["tv_distance"] = report.sprinter["tv_distance"]
    return result


FIELD_RULES = tuple(rule for rule in DECODING_BASELINES if rule not in ("constant_k", "confidence"))
"""The free rules of the field beside constant K and draft confidence (SVIP is AdaEDL with a fixed λ)."""


def serving_summary(serving: dict[str, Any], cost_ratio: float) -> dict[str, Any]:
    """The head's batch planner (the goodput planner fed the expected-acceptance head where it was decoded, else the
    verify budget) in the CPU view with the draft at `cost_ratio` × the target and in each accelerator (roofline) view:
    per batch size, its change against constant K and against the best per-request rule, with paired intervals."""
    planner = next((p for p in PLANNED_BY_HEAD if any(r["policy"] == p for r in serving["rows"])), "budget")
    views = [f"draft at {cost_ratio:g} × target", *sorted({r["costs"] for r in serving["rows"]
                                                            if r["costs"].startswith("roofline")})]
    by_view = {}
    for view in views:
        rows = {row["batch_size"]: row for row in serving["rows"] if row["policy"] == planner and row["costs"] == view}
        if rows:
            by_view[view] = {size: {key: row.get(key) for key in ("vs_constant_k", "vs_constant_k_ci", "best_per_request",
                                                                   "vs_best_per_request", "vs_best_per_request_ci")}
                             for size, row in sorted(rows.items())}
    return {"planner": planner, "left_out": serving.get("left_out", {}).get(planner), "views": by_view}


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
        "heads": {head: head_summary(reports[head], layout, head) for head in reports},
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
    c = cost_words(d["t_draft_over_t_target"], d.get("head_forward_cost"))
    if d["policy"] == "head":
        line = f"modelled speedup {d['modelled_speedup']:.3f}x at h = {d['threshold']:g}"
    else:
        line = (f"{d['tokens_per_target_call']:.2f} tokens/target call, modelled {d['modelled_speedup']:.3f}x "
                f"at τ-threshold {d['threshold']:g}")
    named = [("constant_k", f"best constant K (K = {d.get('constant_k_threshold', 0):g})"), ("confidence", "confidence")]
    field = max((b for b in FIELD_RULES if f"{b}_speedup" in d), key=lambda b: d[f"{b}_speedup"], default=None)
    if field:
        named.append((field, f"the strongest field rule, {field}"))
    gains = [f"{what} {d[f'{baseline}_speedup']:.3f}x: {d[f'gain_vs_{baseline}'] * 100:+.1f} %"
             + percent_interval(d.get(f"gain_vs_{baseline}_ci"))
             for baseline, what in named if f"gain_vs_{baseline}" in d]
    if gains:
        line += " vs " + "; vs ".join(gains)
    if "head_cost_speedup" in d:
        line += (f"; its rule read from the costs (tuned nowhere) {d['head_cost_speedup']:.3f}x"
                 + (f", {d['head_cost_gain_vs_head'] * 100:+.1f} % against h" if "head_cost_gain_vs_head" in d else ""))
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


PLANNER_WORDS = {"goodput": "verify budget (goodput planner, the head)", "budget": "verify budget"}


def serving_line(figures: dict[str, Any]) -> str | None:
    """The head's batch planner at each serving batch size, per cost view, in one line; None without a serving table."""
    serving = figures.get("serving")
    if not serving:
        return None
    words = PLANNER_WORDS.get(serving["planner"], serving["planner"])
    if not serving["views"]:
        return f"serving: no {words} ({serving['left_out'] or 'not decoded'})"
    parts = []
    for view, sizes in serving["views"].items():
        cells = []
        for size, row in sizes.items():
            cell = f"B = {size} {row['vs_constant_k'] * 100:+.1f} %" + percent_interval(row["vs_constant_k_ci"])
            if row.get("best_per_request"):
                cell += (f" (vs {row['best_per_request']} {row['vs_best_per_request'] * 100:+.1f} %"
                         + percent_interval(row["vs_best_per_request_ci"]) + ")")
            cells.append(cell)
        parts.append(f"{view}: " + "; ".join(cells))
    return f"serving, {words} vs constant K — " + " | ".join(parts)


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
    rivals = []
    gain = d.get("gain_vs_constant_k_ci")
    if d and (d.get("indicative") or gain is None or gain[0] <= 0 <= gain[1]):
        rivals.append("the best constant K")
    strongest, ci = d.get("strongest_baseline"), d.get("gain_vs_strongest_baseline_ci")
    if strongest and strongest != "constant_k" and (d.get("indicative") or ci is None or ci[0] <= 0 <= ci[1]):
        rivals.append(strongest)
    if rivals:
        open_questions.append(f"whether it decodes faster than {' or '.join(rivals)}")
    return open_questions


def scale_lines(summary: dict[str, Any]) -> list[str]:
    """What the figures rest on, where a free rule decodes faster than the head, and, where either holds, why and where
    the larger runs are."""
    lines, trained_here = [], False
    for head, figures in summary["heads"].items():
        before = len(lines)
        questions = unresolved(figures)
        tested = (figures.get("decoding") or {}).get("test_prompts", 0)
        if questions:
            lines.append(f"  scale    {figures['title']}: {figures['held_out_tokens']:,} held-out tokens and "
                         f"{count(tested, 'test prompt')} do not settle {' or '.join(questions)}")
        d = figures.get("decoding") or {}
        ci = d.get("gain_vs_strongest_baseline_ci")
        if ci is not None and ci[1] < 0 and not d.get("indicative"):
            lines.append(f"  scale    {figures['title']}: {d['strongest_baseline']} decodes faster on these "
                         f"{count(tested, 'test prompt')} ({d['gain_vs_strongest_baseline'] * 100:+.1f} %"
                         f"{percent_interval(ci)})")
        trained_here = trained_here or (head != SHIPPED and len(lines) > before)
    if trained_here:  # the shipped head was trained on far more than the demo's data
        tokens = summary.get("data", {}).get("labelled_tokens", 0)
        lines.append(f"           a head trained on {tokens:,} labelled tokens reads little beyond the draft's own "
                     "signals; docs/results.md has the heads' standing on 66 k tokens and 160 test prompts")
    return lines


def exported_words(exported: str) -> str:
    """Where a head's folder is: the demo's export, or the name a shipped head loads by."""
    return f"loads as {exported}" if exported.startswith("load_head") else f"exported {relative(exported)}"


def summary_text(summary: dict[str, Any]) -> str:
    """The one-screen summary printed at the end of the demo."""
    data, pair = summary["data"], summary["pair"]
    size = "quick: a smoke run of every stage, too small to rank anything" if summary["size"] == "quick" else summary["size"]
    lines = [f"specheads demo ({size}) finished in {duration(summary['seconds']['total'])}",
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
                  *[f"    {line}" for line in [serving_line(figures)] if line],
                  f"    {exported_words(figures['exported'])}   report {relative(figures['report'])}"]
    lines += scale_lines(summary)
    stages = " · ".join(f"{key} {duration(value)}" for key, value in summary["seconds"].items() if key != "total")
    lines += [f"  stages   {stages}", f"  report   {relative(summary['report'])}",
              "  load a head: specheads.heads.load_head(folder) (docs/decoding-core.md); the figures are in summary.json"]
    return "\n".join(lines)
