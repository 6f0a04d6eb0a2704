"""The plain-language verdict and the report (report.md, rendered to report.html) of a `Report` (metrics.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import markdown

from specheads.artifacts.report_file import Report, tuned_row
from specheads.decoding.drafters import DRAFTER_KINDS
from specheads.decoding.rules import BASELINES as DECODING_BASELINES
from specheads.decoding.rules import DRAFTER_BASELINES
from specheads.eval.config import GRID_FIELDS, flag
from specheads.eval.offline import BASELINES, DRAFTER_SIGNALS, HEAD_SIGNALS, READS_DRAWN_TOKEN, SIGNAL_ORDER
from specheads.eval.plots import PLOTS
from specheads.eval.serving import PLANNED_BY_HEAD
from specheads.plumbing.files import write_text_atomic
from specheads.plumbing.text import count

MIN_TEST_PROMPTS = 8
"""Below this many test prompts a decoding comparison is called indicative, not a finding."""


def decoding_verdict(decoding: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """How the learned policy's tuned threshold fares on test prompts against the tuned baselines."""
    learned = "head" if decoding.get("head_left_out") or any(r["policy"] == "head" for r in decoding["policies"]) \
        else "sprinter"
    mine = tuned_row(decoding, learned)
    tested = decoding["prompts"]["test"]
    result: dict[str, Any] = {"policy": learned, "test_prompts": tested, "indicative": tested < MIN_TEST_PROMPTS}
    lines = [f"Decoding figures rest on {count(tested, 'test prompt')} × {decoding['max_new_tokens']} "
             "new tokens" + (f": indicative only, not a finding (fewer than {MIN_TEST_PROMPTS} test prompts; decode more "
                             "with --num-decode-prompts)." if result["indicative"] else ".")]
    drafter = decoding.get("drafter")
    if drafter:
        lines.append(f"Every decoding run drafted with the {DRAFTER_KINDS[drafter['kind']]} drafter {drafter['folder']} "
                     "(its forwards counted as they ran: a DSpark block is one forward a round).")
    for baseline in (*DECODING_BASELINES, *DRAFTER_BASELINES, "oracle"):
        row = tuned_row(decoding, baseline)
        if row is not None:
            result[f"{baseline}_threshold"] = row["threshold"]
            result[f"{baseline}_speedup"] = row["modelled_speedup"]
            if mine is not None:
                result[f"gain_vs_{baseline}"] = mine["modelled_speedup"] / row["modelled_speedup"] - 1
                result[f"gain_vs_{baseline}_ci"] = decoding.get("gain_intervals", {}).get(baseline)
    if mine is None and decoding.get("head_left_out"):  # a feature drafter drafted: only the free rules decoded
        result["note"] = f"the head's rules were not decoded: {decoding['head_left_out']}"
        return result, lines + [result["note"][0].upper() + result["note"][1:] + "."]
    if mine is None:
        result["note"] = ("no SPRINTER threshold of the sweep kept the distance from the target within the budget on dev "
                          "prompts: the verifier keeps its untuned default (try higher --sprinter-thresholds or a "
                          "larger --sprinter-max-tv)" if learned == "sprinter" else "no decoding run of the head policy")
        return result, lines + [result["note"][0].upper() + result["note"][1:] + "."]
    result.update(threshold=mine["threshold"], modelled_speedup=mine["modelled_speedup"])
    costs = cost_words(decoding["t_draft_over_t_target"], decoding.get("head_forward_cost"))
    result["head_forward_cost"] = decoding.get("head_forward_cost")
    verdict_lines = head_verdict_lines if learned == "head" else sprinter_verdict_lines
    return result, lines + verdict_lines(decoding, result, mine, costs)


def head_verdict_lines(decoding: dict[str, Any], result: dict[str, Any], mine: dict[str, Any], costs: str) -> list[str]:
    """The head policy's verdict on test prompts (`mine`: its tuned row), at `costs`: its speedup, its gain over each
    free rule with its interval (`result`, as `decoding_verdict` filled it), over the strongest, the cost rules', the
    oracle's bound."""
    where = "given in the config" if given_thresholds(decoding) else "tuned on dev prompts"
    lines = [f"At {costs}, the head policy (threshold {mine['threshold']:g}, {where}) "
             f"reaches a modelled speedup of {mine['modelled_speedup']:.3f}× on test prompts."]
    for baseline, what in {**DECODING_BASELINES, **DRAFTER_BASELINES}.items():
        if f"gain_vs_{baseline}" in result:
            gain = result[f"gain_vs_{baseline}"]
            ci = result[f"gain_vs_{baseline}_ci"]
            lines.append(f"That is {abs(gain) * 100:.1f} % {'above' if gain >= 0 else 'below'} {what} "
                         f"({result[f'{baseline}_speedup']:.3f}× at {result[f'{baseline}_threshold']:g})"
                         + (f"; 95 % interval over test prompts {ci[0] * 100:+.1f} % to {ci[1] * 100:+.1f} %." if ci
                            else "."))
    lines += strongest_baseline_lines(result)
    lines += cost_rule_lines(decoding, result) + cost_rule_lines(decoding, result, "head_cost_online")
    if "oracle_speedup" in result:
        lines += oracle_lines(decoding, result)
    return lines


def sprinter_verdict_lines(decoding: dict[str, Any], result: dict[str, Any], mine: dict[str, Any],
                           costs: str) -> list[str]:
    """SPRINTER's verdict on test prompts (`mine`: its tuned row), at `costs`: tokens per target call, and its text's
    log-likelihood under the target against exact SD's (the quality proxy), both added to `result`."""
    plain = tuned_row(decoding, "constant_k")
    result["tokens_per_target_call"] = mine["tokens_per_target_call"]
    lines = [f"SPRINTER at threshold {mine['threshold']:g} generates {mine['tokens_per_target_call']:.2f} tokens per "
             f"target call (modelled speedup {mine['modelled_speedup']:.3f}× at {costs})."]
    if plain and mine.get("mean_target_logprob") is not None and plain.get("mean_target_logprob") is not None:
        difference = mine["mean_target_logprob"] - plain["mean_target_logprob"]
        result["target_logprob_vs_sd"] = difference
        lines.append(f"Exact speculative decoding with K = {plain['threshold']:g} makes {plain['tokens_per_target_call']:.2f} "
                     f"tokens per call. Under the target, SPRINTER's text has a mean log-likelihood of "
                     f"{mine['mean_target_logprob']:.3f} nats/token against {plain['mean_target_logprob']:.3f} for exact "
                     f"SD: {logprob_difference(difference)} (the quality proxy; SPRINTER is approximate by design).")
    return lines


def cost_words(cost_ratio: float, head_cost: float | None) -> str:
    """The costs a modelled speedup is counted at, as every figure states them: `t_draft/t_target = 0.2, a head forward
    0.0315 of a draft forward`; a report from before the head's forwards were counted (`head_cost` None) says so."""
    if head_cost is None:
        return f"t_draft/t_target = {cost_ratio:g} (the head's forwards counted free: a report from before they were priced)"
    return f"t_draft/t_target = {cost_ratio:g}, a head forward {head_cost:.3g} of a draft forward"


def strongest_baseline_lines(result: dict[str, Any]) -> list[str]:
    """Name the free rule with the highest test speedup (the hardest one for the head to beat) and the head's margin
    over it, recorded in `result` as `strongest_baseline` and `gain_vs_strongest_baseline` (with `_ci`), and the free
    rules this eval did not decode (`baselines_not_decoded`: not asked for, or left out of the thresholds it took)."""
    speedups = {b: result[f"{b}_speedup"] for b in (*DECODING_BASELINES, *DRAFTER_BASELINES) if f"{b}_speedup" in result}
    if not speedups:
        return []
    strongest = max(speedups, key=speedups.get)
    gain, ci = result[f"gain_vs_{strongest}"], result[f"gain_vs_{strongest}_ci"]
    result.update(strongest_baseline=strongest, strongest_baseline_speedup=speedups[strongest],
                  gain_vs_strongest_baseline=gain, gain_vs_strongest_baseline_ci=ci)
    beats = gain > 0 and ci is not None and ci[0] > 0
    missing = [b for b in DECODING_BASELINES if b not in speedups]
    result["baselines_not_decoded"] = missing
    lines = [f"The strongest free rule on the test prompts is {strongest} ({speedups[strongest]:.3f}×): the head is "
             f"{gain * 100:+.1f} %" + (f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f} %]" if ci else "")
             + (", above it with the interval above zero." if beats else
                ", not above it with the interval above zero: a free rule does as well here.")]
    if missing:
        lines.append(f"Not decoded here, so not among the rules compared: {', '.join(missing)}.")
    return lines


def cost_rule_lines(decoding: dict[str, Any], result: dict[str, Any], rule: str = "head_cost") -> list[str]:
    """The head's rule read from the costs (decoded at the stated c, tuned nowhere; `head_cost_online`: on the head
    calibrated while serving) against the head's tuned threshold and the strongest free rule, recorded in `result` as
    `<rule>_speedup` and `<rule>_gain_vs_*`."""
    row = tuned_row(decoding, rule)
    if row is None:
        return []
    intervals = decoding.get(f"{rule}_gain_intervals") or {}
    result[f"{rule}_speedup"] = row["modelled_speedup"]
    against = [("head", "the head's tuned threshold", result["modelled_speedup"])]
    strongest = result.get("strongest_baseline")
    if strongest:
        against.append((strongest, f"the strongest free rule, {strongest}", result[f"{strongest}_speedup"]))
    parts = []
    for other, what, theirs in against:
        gain, ci = row["modelled_speedup"] / theirs - 1, intervals.get(other)
        result[f"{rule}_gain_vs_{other}"], result[f"{rule}_gain_vs_{other}_ci"] = gain, ci
        parts.append(f"{gain * 100:+.1f} %" + (f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]" if ci else "")
                     + f" against {what}")
    which = "The head's rule read from the costs" + (" on the head calibrated while serving" if rule != "head_cost" else "")
    return [f"{which} (c = {row['threshold']:g}, tuned nowhere) reaches "
            f"{row['modelled_speedup']:.3f}× on the test prompts: " + "; ".join(parts) + "."]


def logprob_difference(difference: float) -> str:
    """SPRINTER's target log-likelihood minus exact SD's, signed and said in words (one wording for report and demo)."""
    side = "lower" if difference < 0 else "higher" if difference > 0 else "the same"
    return f"{difference:+.3f} nats/token ({side} than exact SD)"


def oracle_lines(decoding: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """The hindsight oracle's speedup, worded as a bound in expectation, and the policies that beat it on these test
    prompts (recorded in `result["beat_the_oracle"]`): a sign that the sample is too small to rank policies."""
    oracle = result["oracle_speedup"]
    beaten = {row["policy"]: row for row in decoding["policies"]
              if row["policy"] != "oracle" and row["modelled_speedup"] > oracle
              and row["modelled_speedup"] >= max(r["modelled_speedup"] for r in decoding["policies"]
                                                 if r["policy"] == row["policy"])}
    result["beat_the_oracle"] = sorted(beaten)
    lines = [f"The hindsight oracle (K_max drafts, only the accepted ones counted) reaches {oracle:.3f}×: it bounds a stop "
             "policy in expectation, not on every small sample."]
    if beaten:
        named = ", ".join(f"{policy} ({row['modelled_speedup']:.3f}× at {row['threshold']:g})" for policy, row in beaten.items())
        lines.append(f"Warning: {named} beat{'s' if len(beaten) == 1 else ''} the oracle on these test prompts, which only "
                     "chance allows: too few test tokens to rank the policies.")
    return lines


def grid_edge_lines(decoding: dict[str, Any]) -> list[str]:
    """A warning for each policy whose dev-tuned threshold is an end of its grid, with the flag that widens it."""
    lines = []
    for policy, end in decoding.get("tuned_at_grid_edge", {}).items():
        threshold = decoding["tuned_thresholds"][policy]
        lines.append(f"Warning: {policy}'s tuned threshold {threshold:g} is the {end} of its grid, so its best may lie "
                     f"beyond it; widen the grid ({flag(GRID_FIELDS[policy])}) before trusting comparisons with it.")
    return lines


def verdict(report: Report) -> dict[str, Any]:
    """Does the head beat the baselines, by how much, at which threshold: numbers and sentences."""
    offline = report.offline
    comparison = report.offline_comparison
    head_auc, best = offline["head"]["auc"], comparison["baseline"]
    kl, kl_constant = offline["head"]["binary_kl"], offline["constant"]["binary_kl"]
    result: dict[str, Any] = {
        "beats_every_baseline_auc": all(head_auc > offline[name]["auc"] for name in BASELINES if name in offline),
        "auc_margin": comparison["auc_margin"], "auc_margin_ci": comparison["auc_margin_ci"], "best_baseline": best,
        "binary_kl_below_constant": kl < kl_constant, "binary_kl_reduction": 1 - kl / kl_constant,
    }
    ci = comparison["auc_margin_ci"]
    lines = [f"Offline, the head's AUC is {head_auc:.3f} against {offline[best]['auc']:.3f} for the best training-free "
             f"signal ({best}): a margin of {comparison['auc_margin']:+.3f}"
             + (f" (95 % bootstrap interval over prompts {ci[0]:+.3f} to {ci[1]:+.3f})." if ci else "."),
             f"Its binary KL is {kl:.3f} against {kl_constant:.3f} for the constant predictor "
             f"({result['binary_kl_reduction'] * 100:.1f} % lower)." if kl < kl_constant else
             f"Its binary KL {kl:.3f} is NOT below the constant predictor's {kl_constant:.3f}.", *margin_lines(report),
             *drafter_lines(report)]
    if report.decoding:
        result["decoding"], more = decoding_verdict(report.decoding)
        lines += more + grid_edge_lines(report.decoding)
    result["text"] = lines
    return result


def margin_lines(report: Report) -> list[str]:
    """The head beside the top-2 margin (vLLM's estimator on it, fitted causally along the same tokens), or why the
    margin is not scored (data labelled before gen stored `top2`)."""
    if report.data.get("margin_note"):
        return [f"The top-2 margin is not scored: {report.data['margin_note']}."]
    comparison = report.offline_comparison.get("top2_margin")
    if not comparison:  # a report from before the margin was scored
        return []
    head, margin = report.offline["head"], report.offline["vllm_margin"]
    ci = comparison["auc_margin_ci"]
    return [f"Beside the top-2 logit margin fitted online (vllm_margin, causally along the same tokens): AUC "
            f"{margin['auc']:.3f} against the head's {head['auc']:.3f}, a head margin of {comparison['auc_margin']:+.3f}"
            + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "") + f"; binary KL {fmt(margin['binary_kl'])} against "
            f"{fmt(head['binary_kl'])}" + cumulative_ece_note(report.cumulative) + "."]


def drafter_lines(report: Report) -> list[str]:
    """The head beside a DSpark drafter's own confidence head on the same tokens, with and without its per-position
    temperatures, where the data stores its score."""
    comparison = report.offline_comparison.get("dspark_confidence")
    if not comparison:
        return []
    head, ours = report.offline["dspark_confidence"], report.offline["head"]
    scaled = report.offline.get("dspark_confidence_ts")
    ci = comparison["auc_margin_ci"]
    ece = {stage: " ".join(fmt(r["ece"]) for r in sorted(report.cumulative or (), key=lambda r: r["k"])
                           if r["stage"] == stage) for stage in ("raw", "calibrated", *DRAFTER_SIGNALS)}
    ours_stage = "calibrated" if ece["calibrated"] else "raw"
    line = (f"Beside the DSpark drafter's own confidence head (dspark_confidence, its score before each draw): AUC "
            f"{head['auc']:.3f} against the head's {ours['auc']:.3f}, a head margin of {comparison['auc_margin']:+.3f}"
            + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "") + f"; binary KL {fmt(head['binary_kl'])}"
            + (f" ({fmt(scaled['binary_kl'])} with its temperatures, {report.data['dspark_temperatures']['how']})"
               if scaled else f" (no temperatures: {report.data.get('dspark_temperatures', {}).get('how', 'none fitted')})")
            + f" against the head's {fmt(ours['binary_kl'])}")
    if ece["dspark_confidence"]:
        line += (f"; cumulative ECE at k = 1, 2, …: {ece['dspark_confidence']}"
                 + (f" ({ece['dspark_confidence_ts']} with temperatures)" if ece["dspark_confidence_ts"] else "")
                 + f" against the head's ({ours_stage}) {ece[ours_stage]}")
    return [line + "."]


def cumulative_ece_note(rows: list[dict[str, Any]] | None) -> str:
    """'; cumulative ECE at k = 1..K: …' of the head (calibrated where it is) and the margin, or nothing."""
    stages = {row["stage"] for row in rows or ()}
    head = "calibrated" if "calibrated" in stages else "raw"
    if "vllm_margin" not in stages:
        return ""
    ece = {stage: " ".join(fmt(r["ece"]) for r in sorted(rows or (), key=lambda r: r["k"]) if r["stage"] == stage)
           for stage in (head, "vllm_margin")}
    return f"; cumulative ECE at k = 1, 2, …: {ece['vllm_margin']} against the head's ({head}) {ece[head]}"


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def interval_cell(value: float | None, ci: list[float] | None) -> str:
    """`value [lo, hi]`."""
    return fmt(value) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def offline_table(report: Report) -> list[str]:
    """The offline metrics as a markdown table."""
    lines = ["| signal | reads ŷ_k? | AUC [95 % CI] | AUC (Bernoulli draws) | PR-AUC | Brier | ECE | binary KL [95 % CI] |",
             "|---|---|---|---|---|---|---|---|"]
    head_reads = "no" if report.head.config.get("decides") == "before_draw" else "yes"
    for name in SIGNAL_ORDER:
        m = report.offline.get(name)
        if m is None:  # a report of an older version, before this signal was scored
            continue
        reads = head_reads if name in HEAD_SIGNALS else ("yes" if READS_DRAWN_TOKEN[name] else "no")
        lines.append(f"| {name} | {reads} | {interval_cell(m['auc'], m['auc_ci'])} | {fmt(m['auc_bernoulli'])} | {fmt(m['pr_auc'])} "
                     f"| {fmt(m['brier'])} | {fmt(m['ece'])} | {interval_cell(m['binary_kl'], m['binary_kl_ci'])} |")
    return lines


def decoding_table(rows: list[dict[str, Any]]) -> list[str]:
    """The decoding runs (test prompts) as a markdown table; tuned thresholds in bold."""
    lines = ["| policy | threshold | discard rate | verification rate | draft forwards/token (head's included) "
             "| mean accepted length "
             "| tokens/target call | tokens/s | modelled speedup | target log-lik |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mark = "**" if row.get("tuned") else ""
        lines.append(f"| {mark}{row['policy']}{mark} | {mark}{row['threshold']:g}{mark} | {fmt(row['discard_rate'])} "
                     f"| {fmt(row['verification_rate'])} | {fmt(row.get('draft_forwards_per_token'))} "
                     f"| {fmt(row['mean_accepted_length'], 2)} "
                     f"| {fmt(row['tokens_per_target_call'], 2)} | {fmt(row['tokens_per_s'], 1)} "
                     f"| {fmt(row['modelled_speedup'])} | {fmt(row['mean_target_logprob'])} |")
    return lines


def report_markdown(report: Report, plot_dir: str = "", depth: int = 1) -> str:
    """The whole report as markdown: plots linked as `plot_dir` + file name, the title at heading level `depth`."""
    head, data = report.head, report.data
    rule = report.decision_rule
    title, section = "#" * depth, "#" * (depth + 1)
    plot = {name: plot_dir + file for name, file in PLOTS.items()}
    lines = [f"{title} Acceptance head report: {head.head_type}", "",
             f"Head `{head.source}` ({head.parameters:,} parameters, reads `{head.reads}`), draft "
             f"`{head.draft}`, target `{head.target}`. Data `{data['path']}` (fingerprint `{data['fingerprint']}`): "
             f"{data['tokens']:,} labelled tokens from {data['prompts']} held-out prompts (prompts the head did not train or calibrate "
             f"on; {data.get('prompts_trained_on', 0)} of the data's prompts it trained on are left out), label {data['label']}, "
             f"mean {data['mean_label']:.3f}.", "", f"{section} Verdict", ""]
    lines += [f"- {line}" for line in report.verdict["text"]]
    lines += ["", f"Decision rule: `{rule.rule}` at threshold {rule.threshold:g} "
                  f"({rule_origin(report)}).", "",
              f"{section} Offline metrics (held-out tokens)", "", *offline_table(report), "",
              "AUC is the expectation over soft labels; intervals are bootstrap over prompts. " + ceiling_caption(report), "",
              f"![ROC]({plot['roc']})", "", f"![Reliability diagram]({plot['reliability']})", ""]
    if report.cumulative:
        lines += cumulative_section(report.cumulative, section, plot["cumulative_reliability"])
    if report.sprinter:
        sprinter = report.sprinter
        lines += [f"{section} SPRINTER operating point", "",
                  f"At threshold {sprinter['threshold']:g} the verifier passes {sprinter['passed_share'] * 100:.1f} % of the "
                  f"held-out drafted tokens unverified; the total-variation distance of SPRINTER's output from the "
                  f"target's is {sprinter['tv_distance']:.4f} per generated token (the mean of passed · (1 − min(1, p/q))).",
                  "", "| τ | FPR | TPR |", "|---|---|---|"]
        lines += [f"| {p['tau']:g} | {p['fpr']:.3f} | {p['tpr']:.3f} |" for p in sprinter["operating_points"]]
        lines.append("")
    if report.decoding:
        decoding = report.decoding
        costs = decoding["measured_costs"]
        lines += [f"{section} Decoding runs (test prompts)", "",
                  f"{count(decoding['prompts']['test'], 'test prompt')} ({tuning_note(decoding)}), "
                  f"{decoding['max_new_tokens']} new tokens each, K_max {decoding['max_draft']}. Modelled "
                  f"speedup from counted forwards, {speedup_basis(decoding)}; {measured_costs_note(costs)} "
                  f"The loop spends {costs['loop_overhead_share'] * 100:.1f} % of wall time outside the forwards. The oracle's wall "
                  f"time is its constant-K_max run's.{reuse_note(decoding)}", "", *decoding_table(decoding["policies"]), "",
                  f"![Pareto frontier]({plot['pareto']})", "", f"![Accepted lengths]({plot['acceptance_lengths']})", ""]
        if decoding.get("trees"):
            lines += tree_lines(decoding["trees"], decoding, section)
        if decoding.get("serving"):
            lines += serving_lines(decoding["serving"], section, plot["serving"])
    return "\n".join(lines) + "\n"


TREE_NAMES = {"head": "head values", "confidence": "confidence values"}


def tree_lines(trees: dict[str, Any], decoding: dict[str, Any], section: str) -> list[str]:
    """The tree-draft section: each tree at its tuned floor (and grown by the costs) on the test prompts, and its gain
    over the chain rules and, for head values, over confidence values, with paired 95 % intervals over prompts."""
    c = trees["cost_ratio"]
    origin = ("floors given in the config (--fixed-thresholds)" if given_thresholds(decoding) else
              f"floors tuned on the {decoding['tuned_from']['dev_prompts']} dev prompts of `{decoding['tuned_from']['report']}`"
              if decoding.get("tuned_from") else
              f"floors tuned on the dev prompts among {', '.join(f'{f:g}' for f in trees['floors'] or [])}")
    lines = [f"{section} Tree drafts (test prompts)", "",
             f"Token trees of at most N nodes per target forward (N = {', '.join(str(n) for n in trees['budgets'])}; at "
             f"most {trees['width']} children a node, {trees['expand']} nodes read per draft forward), drawn from q "
             "without replacement and verified by recursive rejection sampling, so the output is the target's "
             "distribution; the prompts' trees verified together, each as it decodes alone. Growth either by a floor "
             f"({origin}) or read from the costs at c = {c:g} (floor 0, tuned nowhere). Counting: {trees['counting']}. "
             f"Modelled speedup at {cost_words(c, decoding.get('head_forward_cost'))}; the chain rules are at their tuned "
             "thresholds.", "",
             "| N | values | growth | tokens/target call | draft forwards/target call (head's included) "
             "| mean accepted length "
             "| modelled speedup |", "|---|---|---|---|---|---|---|"]
    tuned = [r for r in trees["policies"] if r.get("tuned")]
    for row in sorted(tuned, key=lambda r: (r["budget"], r["growth"] == "costs", r["values"] != "head")):
        growth = f"costs, c = {row['threshold']:g}" if row["growth"] == "costs" else f"floor {row['threshold']:g}"
        lines.append(f"| {row['budget']} | {TREE_NAMES[row['values']]} | {growth} | {fmt(row['tokens_per_target_call'], 2)} "
                     f"| {fmt(row['draft_forwards_per_target_call'], 2)} | {fmt(row['mean_accepted_length'], 2)} "
                     f"| {fmt(row['modelled_speedup'])} |")
    if trees["gains"]:
        lines += ["", "| N | tree | against | modelled speedup [95 % paired] | tokens/target call |", "|---|---|---|---|---|"]
        for gain in trees["gains"]:
            ci = gain["speedup_gain_ci"]
            lines.append(f"| {gain['budget']} | {gain['policy']} | {gain['against']} @ {gain['against_threshold']:g} "
                         f"| {gain['speedup_gain']:+.1%}" + percent_ci(ci) + f" | {gain['tokens_per_target_call_gain']:+.1%} |")
    for policy, end in trees.get("tuned_at_grid_edge", {}).items():
        lines += ["", f"Warning: {policy}'s tuned floor {trees['tuned_floors'][policy]:g} is the {end} of its grid, so "
                      f"its best may lie beyond it; widen the grid (--tree-floors) before trusting comparisons with it."]
    left_out = [f"{policy} is not decoded: {why}." for policy, why in trees.get("left_out", {}).items()]
    return [*lines, *([""] + left_out if left_out else []), ""]


def speedup_basis(decoding: dict[str, Any]) -> str:
    """How the report's modelled speedups were computed, with the cost ratio; a report written before they were
    counted says that it used Eq. 5.1."""
    c = decoding["t_draft_over_t_target"]
    companion = (f"; SV's companion forwards count as {decoding['sv_companion_cost']:.3g} draft forwards each"
                 if "sv_companion_cost" in decoding else "")
    head = (f"; each token the head scores costs {decoding['head_forward_cost']:.3g} draft forwards (its weights over "
            "the draft's), and the free signals (draft confidence, SVIP, AdaEDL, vLLM's estimator) read what the draft "
            "computed, at no extra cost" if decoding.get("head_forward_cost") is not None else
            "; the head's forwards are counted free (a report from before they were priced)")
    if decoding.get("speedup_from"):
        return f"{decoding['speedup_from']} at c = t_draft/t_target = {c:g} (in target-forward units){head}{companion}"
    return (f"SpecDec++ Eq. 5.1 at t_draft/t_target = {c:g} (this report predates counted speedups: Eq. 5.1 "
            "overstates SPRINTER; evaluate again)")


def ceiling_caption(report: Report) -> str:
    """What `label_ceiling` means for these labels: a bound below 1 for soft labels, trivially 1 for hard ones."""
    ceiling = report.offline["label_ceiling"]["auc"]
    if ceiling is not None and ceiling >= 0.9995:
        return ("`label_ceiling` scores each token by its own label; these labels are 0/1 outcomes, so it reaches 1 and "
                "bounds nothing.")
    return ("`label_ceiling` scores each token by its own label: soft labels are noisy, so no predictor reaches 1 "
            "and this is the best AUC any predictor could reach here.")


def cumulative_section(rows: list[dict[str, Any]], section: str, plot: str) -> list[str]:
    """The cumulative acceptance per round position: a table before and after the calibration, and the plot."""
    lines = [f"{section} Cumulative acceptance per round position (held-out tokens)", "",
             "Π_{j≤k} â_j against Π_{j≤k} min(1, p/q), the chance that candidates 1..k are all accepted, over every run "
             "of k consecutive drafted candidates (windows); `calibrated` applies the head's per-position map, fitted on "
             "calibration prompts that are not among these; `head_online`, `vllm_current`, `vllm_margin` (…) take the "
             "online fits' scores instead, each fitted causally along the same tokens (one intercept: offline tokens "
             "have no round position).", "",
             "| k | stage | windows | mean label | mean Π â | AUROC | ECE [95 % over prompts] | Brier |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['stage']} | {r['windows']:,} | {fmt(r['mean_label'])} | {fmt(r['mean_prediction'])} "
              f"| {fmt(r['auroc'])} | {fmt(r['ece'])}{ci_note(r.get('ece_ci'))} | {fmt(r['brier'])} |"
              for r in sorted(rows, key=lambda r: (r["k"], r["stage"] != "raw"))]
    return [*lines, "", f"![Cumulative reliability]({plot})", ""]


def ci_note(ci: list[float] | None) -> str:
    """' [lo, hi]' to three decimals, or nothing."""
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def queue_note(serving: dict[str, Any]) -> str:
    """How long the queue is when the test prompts are sampled more than once (`eval --test-samples`)."""
    samples = serving.get("samples_per_test_prompt", 1)
    if samples <= 1:
        return ""
    return (f" (a queue of {serving['requests']} requests: {samples} samples of each test prompt, each with its own "
            "seed; a prompt's samples are resampled together)")


def serving_lines(serving: dict[str, Any], section: str, plot: str) -> list[str]:
    """The serving-batch section: throughput per policy, batch size and cost view, which policy wins where, and the
    verify budget's share of the oracle's gain."""
    sizes = serving["batch_sizes"]
    left_out = [f"{policy} is not in this table: {why}." for policy, why in serving.get("left_out", {}).items()]
    title = f"{section} At serving batch sizes (test prompts)"
    if not serving["rows"]:
        return [title, "", *left_out, ""]
    budget = serving.get("budget") or {}
    curves = serving["cost_curves"]
    sources = "; ".join(f"{view}: {about['source']}" + (", modelled at each B" if about.get("per_batch_size") else "")
                        for view, about in curves.items())
    lines = [title, "",
             f"Each policy at its tuned threshold serving B requests together (continuous batching, rounds in lockstep). "
             f"Forward costs: {sources}; measured and given curves also with the draft at "
             f"{serving.get('scaled_draft_ratio')} × the target. The batch policies (the verify budget, floor "
             f"{budget.get('floor')}, K_max {budget.get('max_draft')}; SmartSpec's K; the goodput planner fed the head, "
             "D-Cut's or vLLM's signal) are decoded live at every B and view; the per-request policies are served from "
             "their test runs' rounds. Modelled tokens/s, the change against constant K at the same B with its paired "
             "95 % interval over prompts" + queue_note(serving) + ". " + head_pricing_note(serving), ""]
    for view in serving.get("views") or sorted({row["costs"] for row in serving["rows"]}):
        lines += [f"Costs: {view}", "", "| policy | " + " | ".join(f"B = {b}" for b in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for policy in dict.fromkeys(row["policy"] for row in serving["rows"]):
            cells = []
            for size in sizes:
                row = next((r for r in serving["rows"] if (r["policy"], r["batch_size"], r["costs"]) == (policy, size, view)),
                           None)
                cells.append("" if row is None else f"{row['tokens_per_s']:.1f}{change_note(row)}{warmup_note(row.get('warmup'))}")
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        best = ", ".join(f"B = {size}: {policy}" for size, policy in (serving["best"].get(view) or {}).items())
        lines += ["", f"Best policy (the oracle aside): {best}.", *warmup_lines(serving["rows"], view),
                  *refit_lines(serving["rows"], view),
                  *rival_lines(serving["rows"], view), *signal_lines(serving["rows"], view), ""]
    return [*lines, *left_out, "", f"![Serving throughput]({plot})", ""]


def head_pricing_note(serving: dict[str, Any]) -> str:
    """How the serving table priced the heads' forwards (a table from before it did says they were free)."""
    costs = serving.get("head_forward_costs")
    if costs is None:
        return "The heads' forwards are not priced (a report from before they were)."
    timed = [view for view, about in serving["cost_curves"].items() if about.get("heads")]
    shares = ", ".join(f"the {role} head's {cost:.3g}" for role, cost in costs.items())
    return ("A head's forwards (one per draft step over the tokens it scored) are priced on its curve timed in "
            + (", ".join(timed) if timed else "no view") + f", elsewhere at its share of the draft's weights ({shares}) "
            "times the draft's curve; the free signals cost nothing extra.")


def rival_lines(rows: list[dict[str, Any]], view: str) -> list[str]:
    """Each batch policy against the best per-request policy at each B, with the paired interval."""
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["decoded"] == "live" and r["costs"] == view):
        cells = []
        for row in (r for r in rows if (r["policy"], r["costs"]) == (policy, view) and r.get("best_per_request")):
            ci = row.get("vs_best_per_request_ci")
            cells.append(f"B = {row['batch_size']}: {row['vs_best_per_request']:+.1%}"
                         + percent_ci(ci) + f" against {row['best_per_request']}")
        if cells:
            lines.append(f"{policy} against the best per-request policy: " + "; ".join(cells) + ".")
    return lines


def signal_lines(rows: list[dict[str, Any]], view: str) -> list[str]:
    """Each planner fed the trained head against the batch policies fed free signals (or none) at each B, paired."""
    lines = []
    for policy in PLANNED_BY_HEAD:
        cells = []
        for row in (r for r in rows if (r["policy"], r["costs"], r["decoded"]) == (policy, view, "live")):
            versus = [f"{other} {against['change']:+.1%}" + percent_ci(against["ci"]) + judged_note(against.get("warmup"))
                      for other, against in row.get("vs_live", {}).items() if other not in PLANNED_BY_HEAD]
            if versus:
                cells.append(f"B = {row['batch_size']}: " + ", ".join(versus))
        if cells:
            lines.append(f"{policy} (the trained head) against the planners of free signals: " + "; ".join(cells) + ".")
    return lines


def warmup_note(warmup: dict[str, int] | None) -> str:
    """' [warm-up: P of N rounds past it]' for a live planner that warms up, or nothing."""
    return f" [warm-up: {warmup['past_warmup']} of {warmup['rounds']} rounds past it]" if warmup else ""


def judged_note(warmup: dict[str, int] | None) -> str:
    """What a comparison with a planner still in its warm-up is worth: nothing is judged against one that never
    left it (it checked every candidate to the cap throughout)."""
    if not warmup:
        return ""
    if not warmup["past_warmup"]:
        return f" (not judged: in its warm-up all {warmup['rounds']} rounds)"
    return f" (past its warm-up in {warmup['past_warmup']} of {warmup['rounds']} rounds)"


def warmup_lines(rows: list[dict[str, Any]], view: str) -> list[str]:
    """For each live planner that warms up, how many of its rounds came after the warm-up at each B: until then it
    drafts to the cap and checks every candidate, so where it never left it a comparison with it is one with constant
    K_max and judges nothing of its rule."""
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["costs"] == view and r.get("warmup")):
        runs = [r for r in rows if (r["policy"], r["costs"]) == (policy, view) and r.get("warmup")]
        counts = ", ".join(f"B = {r['batch_size']}: {r['warmup']['past_warmup']} of {r['warmup']['rounds']}" for r in runs)
        line = f"{policy}'s rounds past its warm-up (before it: drafting to the cap, every candidate checked): {counts}."
        stayed = [str(r["batch_size"]) for r in runs if not r["warmup"]["past_warmup"]]
        if stayed:
            line += (f" At B = {', '.join(stayed)} it never left its warm-up: a comparison with it there is one with "
                     "constant K_max and judges nothing of its rule (decode more rounds: more test prompts or "
                     "--test-samples).")
        lines.append(line)
    return lines


def refit_lines(rows: list[dict[str, Any]], view: str) -> list[str]:
    """For each live planner whose estimate refits while serving (every 100 rounds), how often it refitted at each B;
    where it never did, its estimate was its starting one throughout, and the row judges nothing of its calibration."""
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["costs"] == view and "refits" in r):
        runs = [r for r in rows if (r["policy"], r["costs"]) == (policy, view) and "refits" in r]
        line = (f"{policy}'s refits from verify outcomes: "
                + ", ".join(f"B = {r['batch_size']}: {r['refits']}" for r in runs) + ".")
        never = [str(r["batch_size"]) for r in runs if not r["refits"]]
        if never:
            line += (f" At B = {', '.join(never)} it never refitted, so it planned on its starting estimate throughout "
                     "and judges nothing of its online calibration (decode more rounds: longer --max-new-tokens or more "
                     "--test-samples).")
        lines.append(line)
    return lines


def percent_ci(ci: list[float] | None) -> str:
    """' [+lo %, +hi %]' of a paired interval, or nothing."""
    return f" [{ci[0]:+.1%}, {ci[1]:+.1%}]" if ci else ""


def change_note(row: dict[str, Any]) -> str:
    """' (+x % [lo, hi])' against constant K, or nothing for constant K itself."""
    if row["vs_constant_k"] is None or row["policy"] == "constant_k":
        return ""
    ci = row.get("vs_constant_k_ci")
    return f" ({row['vs_constant_k']:+.1%}" + percent_ci(ci) + ")"


def measured_costs_note(costs: dict[str, Any]) -> str:
    """The forward times measured on this machine with the ratio's interval, flagged where the runs cannot settle it."""
    if costs["ratio"] is None:
        return (f"the runs do not determine the ratio on this machine ({costs['undetermined']}), so no speedup at a "
                "measured ratio is given.")
    ci = costs.get("ratio_ci")
    note = (f"on this machine the measured ratio is {costs['ratio']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            + f" (t_draft {costs['t_draft_s'] * 1e3:.1f} ms over {costs.get('draft_passes', 0):.0f} passes, t_target "
            f"{costs['t_target_s'] * 1e3:.1f} ms over {costs.get('target_passes', 0):.0f}; a verification pass reads "
            "K + 1 tokens).")
    if not costs.get("reliable", True):
        note += f" That ratio is unreliable ({costs['caveat']}): do not use it to rank policies."
    return note


def given_thresholds(decoding: dict[str, Any]) -> bool:
    """Whether the decoding ran at thresholds given in the config (--fixed-thresholds), not tuned on dev prompts."""
    earlier = decoding.get("tuned_from")
    return bool(earlier) and earlier["report"] is None


def rule_origin(report: Report) -> str:
    """Where the exported rule's threshold comes from, in a few words."""
    if report.decision_rule.tuned:
        return "tuned on dev prompts"
    if report.decoding and given_thresholds(report.decoding):
        return "given in the config (--fixed-thresholds), tuned elsewhere: not tuned for this head"
    return "untuned default: no decoding runs"


def tuning_note(decoding: dict[str, Any]) -> str:
    """Where the thresholds were tuned."""
    earlier = decoding.get("tuned_from")
    if given_thresholds(decoding):
        return "each policy at a threshold given in the config (--fixed-thresholds, tuned elsewhere), none tuned here"
    if earlier:
        return (f"each policy at the threshold tuned on the {earlier['dev_prompts']} dev prompts of `{earlier['report']}`, "
                "none of them decoded here")
    return f"thresholds tuned on {decoding['prompts']['dev']} dev prompts"


def reuse_note(decoding: dict[str, Any]) -> str:
    """A sentence on the runs taken from an earlier report, or nothing."""
    reused = decoding.get("reused_runs") or {}
    if not reused.get("count"):
        return ""
    return (f" {reused['count']} head-free runs were taken from `{reused['from']}` (same decoding context); their "
            "tokens/s are that report's, and the measured ratio comes from the runs decoded here.")


def write_markdown(text: str, out: Path, title: str) -> None:
    """`out/report.md` and `out/report.html` (the same content, tables rendered, plots inline)."""
    write_text_atomic(out / "report.md", text)
    body = markdown.markdown(text, extensions=["tables"])
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:3px 6px}"
             "img{max-width:100%}")
    write_text_atomic(out / "report.html", f"<!doctype html><html><head><meta charset='utf-8'><title>{title}"
                                           f"</title><style>{style}</style></head><body>{body}</body></html>\n")


def write_report(report: Report, out: Path) -> None:
    """report.md and report.html of one head's evaluation in `out`."""
    write_markdown(report_markdown(report), out, "specheads report")
