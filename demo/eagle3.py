"""The demo's line for the EAGLE-3 pair: the embedded target with an EAGLE-3 drafter trained for it (`--eagle3 DIR`),
decoded at B = 1 in wall clock on this machine against the target alone, rule by rule (`specheads.eval.wall_clock`),
beside the speedup modelled from the same runs' counted forwards at the c they timed. Without a drafter the line says
how to make one: the drafter (19 MB in float16) does not ship with specheads."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from specheads.artifacts.checkpoint import load_trained
from specheads.demo.config import DemoConfig
from specheads.demo.stages import Layout, kept_or_measured, relative
from specheads.eval.sweep import modelled_speedup
from specheads.eval.wall_clock import DrafterBenchmark, benchmark_drafter, stop_head
from specheads.pair.drafter_checks import check_drafter_for
from specheads.pair.drafters import drafter_weights_sha256
from specheads.pair.model_spec import ModelSpec
from specheads.plumbing.errors import UsageError

RULES = {"constant_k:1": "constant K = 1", "transformers:0.4": "transformers' default (confidence 0.4, ROC-tuned)"}
"""The rules the line decodes, none tuned here: constant K = 1, the fastest constant K at B = 1 on the project's CPU,
and transformers' default, the strongest free rule of the EAGLE-3 pair's counted table (docs/results.md)."""
DEMO_TARGET = "embedded:smollm2"
"""The target the line decodes for: the demo's."""
HOW_TO = ("`specheads train drafter --config eagle3-smollm2` trains one for the embedded target (about 2.7 h on 2 CPU "
          "cores), then `specheads demo --eagle3 runs/eagle3/drafter` adds this line")


def benchmark_settings(config: DemoConfig) -> DrafterBenchmark:
    """What the line decodes: a few held-out confirmation prompts (3 × 16 tokens with --quick, else 16 × 32), K_max 4,
    and the head's stop rule read from the costs at `config.eagle3_cost_ratio` where `--eagle3-head` names a head."""
    rules = [*RULES, *([f"head_cost:{config.eagle3_cost_ratio:g}"] if config.eagle3_head else [])]
    return DrafterBenchmark(drafter=str(config.eagle3), target=DEMO_TARGET, prompts=3 if config.quick else 16,
                            max_new_tokens=16 if config.quick else 32, rules=rules, max_draft=4, head=config.eagle3_head,
                            resamples=200 if config.quick else 1000)


def check_eagle3(config: DemoConfig) -> None:
    """Before any stage: `--eagle3` names an EAGLE-3 drafter folder made for the demo's target (its files against the
    target's config, `specheads.pair.drafter_checks`) and `--eagle3-head`, if given, a stop head trained on data that
    drafter labelled; `--eagle3-head` without `--eagle3` is refused."""
    if not config.eagle3:
        if config.eagle3_head:
            raise UsageError("--eagle3-head is decoded with the drafter of --eagle3; give --eagle3 DIR too")
        return
    check_drafter_for(config.eagle3, "eagle3", ModelSpec(path=DEMO_TARGET))
    stop_head(benchmark_settings(config), "eagle3")


def eagle3_line(config: DemoConfig, layout: Layout) -> dict[str, Any]:
    """Decode the line into `eagle3/wall_clock.json` of the demo folder (kept, and reused, while its settings are the
    same) and return it."""
    settings = benchmark_settings(config)
    return kept_or_measured(layout.root / "eagle3" / "wall_clock.json", line_identity(settings),
                            lambda: benchmark_drafter(settings, "eagle3"))


def line_identity(settings: DrafterBenchmark) -> dict[str, Any]:
    """What a kept line must match to be reused: its settings, the drafter's files and the head's weights (a drafter
    or head trained again into the same folder decodes again)."""
    head = load_trained(settings.head).head.weights_digest() if settings.head else None
    return {"settings": asdict(settings), "drafter_sha256": drafter_weights_sha256(settings.drafter),
            "head_weights_digest": head}


def modelled(row: dict[str, Any]) -> float | None:
    """A rule's speedup modelled from its counted forwards (tokens, drafter and head forwards a target call) at the
    costs its runs timed; None where they timed none."""
    c = row.get("timed_cost_ratio")
    if not c:
        return None
    head = row.get("head_forwards_per_target_call", 0.0) * (row.get("timed_head_cost_ratio") or 0.0)
    return modelled_speedup(row["tokens_per_target_call"], row["draft_forwards_per_target_call"] + head / c, 1.0, c)


def eagle3_lines(result: dict[str, Any] | None) -> list[str]:
    """The demo screen's lines for the EAGLE-3 pair: per rule its wall-clock speedup over the target alone with the
    95 % interval over prompts, beside the modelled one; or how to get them."""
    if result is None:
        return [f"  EAGLE-3  not in this run: {HOW_TO}"]
    settings = result["settings"]
    lines = [f"  EAGLE-3  {relative(settings['drafter'])} as the draft, {result['prompts']} held-out prompts × "
             f"{result['max_new_tokens']} tokens, B = 1, wall clock here: target alone "
             f"{result['target_alone_tokens_per_s']:.1f} tokens/s"]
    names = {**RULES, **{rule: f"the head's rule read from the costs ({relative(settings['head'])})"
                         for rule in result["rules"] if rule.startswith("head_cost:")}}
    for rule, row in result["rules"].items():
        interval = row["speedup_interval"]
        band = f" [{1 + interval[0]:.2f}, {1 + interval[1]:.2f}]" if interval else ""
        model = modelled(row)
        beside = f"; modelled from its forwards at the timed c = {row['timed_cost_ratio']:.3f}: {model:.2f}×" if model else ""
        lines.append(f"           {names.get(rule, rule)}: {row['speedup']:.2f}×{band}{beside}")
    return lines
