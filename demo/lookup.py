"""The demo's line for the prompt-lookup pair: the embedded target with prompt lookup as its draft (no draft model, so
nothing to train), decoded greedily at B = 1 in wall clock on this machine against the target alone, rule by rule.

Copy-heavy prompts (`lookup_prompts.jsonl`: code edits, chats that repeat, passages, from
benchmarks/prompts/lookup-confirm.jsonl, the first of each family in turn) are each decoded by the target alone
(`specheads.eval.wall_clock.target_alone`) and then under every rule, back to back, the rules' order rotated from
prompt to prompt, after one short untimed run of each; both sides read the target's linear weights prepacked once
(`specheads.pair.packed`), on one thread, as benchmarks/lookup_decode.py measures the pair. The adaptive rules'
planners price a verify from the target's verify curve, timed first on this machine
(`specheads.decoding.verify_curve`), tuned nowhere. A rule's speedup is the
geometric mean over prompts of its tokens/s over the target alone's on the same prompt, with a bootstrap 95 % interval
over prompts; at T = 0 its tokens must be the target alone's (the decoder is exact), and the line says on how many
prompts they are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.free_replay import geometric_speedup
from specheads.decoding.result import DecodeResult
from specheads.decoding.verify_curve import free_draft_costs, measure_verify_curve
from specheads.demo.config import DemoConfig
from specheads.demo.stages import Layout, kept_or_measured, relative
from specheads.heads.loading import shipped_heads
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST
from specheads.plumbing.errors import UsageError

PROMPTS = str(Path(__file__).resolve().parent / "lookup_prompts.jsonl")
"""The line's prompts: code edits, chats that repeat and passages in turn, so that any first few hold each family."""
SIZES = {"quick": (3, 80), "full": (9, 128)}
"""(prompts, new tokens each) of the quick and full demos' lines: the quick one adds about 20 s to the demo on the
project's 2-core CPU when it is idle (its target alone decodes about 33 tokens/s there)."""
SHIPPED_LOOKUP_HEAD = "smollm2-lookup"
"""The token-only head for prompt lookup that ships with specheads (`shipped_heads`), where it does."""
TABLE_RULE = f"lookup_table:{PACKED_CPU_TOKEN_COST:g}"
HEAD_RULE = f"lookup_plan:{PACKED_CPU_TOKEN_COST:g}"
RULES = {"constant_k:8": "fixed K = 8 (the best K on dev prompts)",
         TABLE_RULE: "vLLM's online acceptance table, verify length read from the costs",
         HEAD_RULE: "the token head's rule (verify length read from the costs)"}
"""The rules the line decodes: fixed K = 8, the best K on the dev prompts (docs/results.md), vLLM's online table and
the token head, each feeding the cost-read planner (its value t = 0.043, a verified token's price in one-token
forwards on the project's CPU, is what it reads where no curve is given: here the measured curve prices a verify)."""
MAX_DRAFT = 32
"""The most tokens the adaptive rules may verify a round."""
VERIFY_REPEATS = 5
"""Timings of each size of the verify curve (`measure_verify_curve`), the median kept."""
DEMO_TARGET = "embedded:smollm2"


@dataclass(frozen=True)
class LookupSettings:
    """What the line decodes: `prompts` of PROMPTS × `max_new_tokens` greedy tokens, `rules`, and the token head
    folder `head` the head's rule reads (None: that rule is left out, `missing` saying why)."""

    prompts: int
    max_new_tokens: int
    rules: tuple[str, ...]
    head: str | None
    missing: str | None = None
    target: str = DEMO_TARGET
    prompt_file: str = PROMPTS
    resamples: int = 1000


def head_folder(config: DemoConfig) -> tuple[str | None, str | None]:
    """(the token head's folder, None) from `--lookup-head` or the shipped head, else (None, why there is none): a
    shipped head that is missing or cannot be read leaves its rule out, said in one line, and fails nothing."""
    if config.lookup_head:
        return config.lookup_head, None
    shipped = shipped_heads().get(SHIPPED_LOOKUP_HEAD)
    if shipped is None:
        return None, (f"no token head ships at heads/shipped/{SHIPPED_LOOKUP_HEAD} in this install: its rule is left "
                      "out (give one with --lookup-head DIR)")
    try:
        load_token_head(str(shipped))
    except UsageError as error:
        return None, f"the shipped token head cannot be read ({error}): its rule is left out"
    return str(shipped), None


def lookup_settings(config: DemoConfig) -> LookupSettings:
    """The line of the demo's size (`SIZES`); the head's rule where a head is found."""
    head, missing = head_folder(config)
    rules = tuple(rule for rule in RULES if head or rule != HEAD_RULE)
    prompts, tokens = SIZES[config.size]
    return LookupSettings(prompts=prompts, max_new_tokens=tokens, rules=rules, head=head, missing=missing)


def load_token_head(folder: str) -> Any:
    """The token-only head of `folder` for prompt lookup, refused in one line when it is none (`TokenHead.load`)."""
    from specheads.lookup.token_head import TokenHead

    if not Path(folder).is_dir():
        raise UsageError(f"--lookup-head {folder} is not a folder; give a token head folder (config.json and "
                         "model.safetensors, `specheads.heads.lookup.TokenHeadModel.export`)")
    return TokenHead.load(folder, "lookup", 0)


def check_lookup(config: DemoConfig) -> None:
    """Before any stage: `--lookup-head`, where given, is a token-only head trained on prompt lookup."""
    if config.lookup_head:
        load_token_head(config.lookup_head)


def make_rules(settings: LookupSettings, costs: ServingCosts) -> dict[str, tuple[Any, Any]]:
    """Each rule's (policy, planner), the planners pricing a verify from `costs` and kept across prompts as a server
    keeps them."""
    from specheads.decoding import make_policy
    from specheads.decoding.free_rules import CostPlanned, EstimatorPlanned

    rules: dict[str, tuple[Any, Any]] = {}
    for rule in settings.rules:
        name, _, value = rule.partition(":")
        if name == "lookup_plan":
            policy = EstimatorPlanned(threshold=float(value), max_draft=MAX_DRAFT,
                                      estimator=load_token_head(str(settings.head)))
        else:
            policy = make_policy(name, float(value), int(float(value)) if name == "constant_k" else MAX_DRAFT)
        rules[rule] = (policy, policy.planner(costs) if isinstance(policy, CostPlanned) else None)
    return rules


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside, as the pair is measured; the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_target(settings: LookupSettings) -> tuple[torch.nn.Module, set[int], int, list[list[int]]]:
    """The target with its linear weights prepacked, its stop ids, how many layers were packed, the encoded prompts."""
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.pair.models import ModelSpec, load_model, load_tokenizer, stop_token_ids
    from specheads.pair.packed import pack_linear_weights

    spec = ModelSpec(path=settings.target)
    tokenizer, target = load_tokenizer(spec), load_model(spec)
    prompts = [encode_prompt(tokenizer, p) for p in load_prompts(settings.prompt_file, limit=settings.prompts)]
    return target, set(stop_token_ids(target, tokenizer)), pack_linear_weights(target), prompts


def decode_line(settings: LookupSettings) -> dict[str, Any]:
    """Decode the line (module docstring): this machine's verify curve, then per prompt the target alone's (tokens,
    seconds) and each rule's (tokens, seconds, whether they are the target alone's tokens, target calls)."""
    from specheads.decoding import RoundEngine
    from specheads.decoding.free_draft import LookupDraft
    from specheads.eval.wall_clock import WARM_UP_TOKENS, target_alone
    from specheads.model_outputs.sampling import SamplingTransform

    target, stops, packed, prompts = load_target(settings)
    transform = SamplingTransform(0.0)
    engine = RoundEngine(target, LookupDraft("ngram"), transform, sorted(stops))
    runs: list[dict[str, Any]] = []
    with one_thread():
        target_alone(target, prompts[0], transform, WARM_UP_TOKENS, 0, stops)
        curve = measure_verify_curve(target, prompts[0], VERIFY_REPEATS)
        rules = make_rules(settings, free_draft_costs(curve))

        def run(rule: str, prompt: list[int], tokens: int, seed: int) -> DecodeResult:
            policy, planner = rules[rule]
            return engine.decode([prompt], policy, tokens, [seed], planner=planner)[0]

        for rule in settings.rules:
            run(rule, prompts[0], WARM_UP_TOKENS, 0)
        for index, prompt in enumerate(prompts):
            alone, seconds = target_alone(target, prompt, transform, settings.max_new_tokens, index, stops)
            record = {"alone": [len(alone), seconds]}
            turn = index % len(settings.rules)
            for rule in settings.rules[turn:] + settings.rules[:turn]:
                result = run(rule, prompt, settings.max_new_tokens, index)
                record[rule] = [len(result.tokens), result.seconds, result.tokens == alone, result.target_calls]
            runs.append(record)
    return {"packed_layers": packed, "families": prompt_families(settings), "runs": runs,
            "verify_curve": {"tokens": list(curve.tokens), "seconds": list(curve.seconds)}}


def prompt_families(settings: LookupSettings) -> list[str]:
    """The family (`category`) of each decoded prompt."""
    with open(settings.prompt_file) as lines:
        return [json.loads(line).get("category", "all") for line in lines if line.strip()][:settings.prompts]


def rule_rows(settings: LookupSettings, runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rule: its speedup over the target alone with its interval, tokens/s, tokens a target call, and on how many
    prompts its tokens are the target alone's."""
    rows = {}
    for rule in settings.rules:
        ratios = np.array([(r[rule][0] / r[rule][1]) / (r["alone"][0] / r["alone"][1]) for r in runs])
        speedup, interval = geometric_speedup(ratios, settings.resamples)
        rows[rule] = {"speedup": speedup, "interval": interval, "per_prompt": ratios.round(4).tolist(),
                      "tokens_per_s": sum(r[rule][0] for r in runs) / sum(r[rule][1] for r in runs),
                      "same_as_target": sum(bool(r[rule][2]) for r in runs),
                      "tokens_per_target_call": sum(r[rule][0] for r in runs) / max(sum(r[rule][3] for r in runs), 1)}
    return rows


def line_identity(settings: LookupSettings) -> dict[str, Any]:
    """What a kept line must match to be reused: its settings and the head's weights (a head exported again into the
    same folder decodes again)."""
    weights = Path(settings.head or "") / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if settings.head and weights.is_file() else None
    return {"settings": json.loads(json.dumps(asdict(settings))), "head_sha256": digest}  # as the kept JSON reads


def measure(settings: LookupSettings) -> dict[str, Any]:
    """The line's figures: what it decoded, the target alone's rate, each rule's row."""
    decoded = decode_line(settings)
    runs = decoded["runs"]
    return {"prompts": len(runs), "max_new_tokens": settings.max_new_tokens, "temperature": 0.0, "threads": 1,
            "packed_layers": decoded["packed_layers"], "families": decoded["families"],
            "verify_curve": decoded["verify_curve"],
            "target_alone_tokens_per_s": sum(r["alone"][0] for r in runs) / sum(r["alone"][1] for r in runs),
            "rules": rule_rows(settings, runs), "runs": runs}


def lookup_line(config: DemoConfig, layout: Layout, settings: LookupSettings | None = None) -> dict[str, Any]:
    """Decode the line into `lookup/wall_clock.json` of the demo folder (kept, and reused, while its settings and
    head are the same) and return it."""
    settings = settings or lookup_settings(config)
    return kept_or_measured(layout.root / "lookup" / "wall_clock.json", line_identity(settings),
                            lambda: measure(settings))


def interval_words(row: dict[str, Any]) -> str:
    """` [lo, hi]` of a rule's speedup (empty without an interval)."""
    return f" [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}]" if row["interval"] else ""


def verify_price(result: dict[str, Any]) -> float:
    """A 9-token verify forward against a one-token one, on the verify curve the line measured."""
    curve = CostCurve(tuple(result["verify_curve"]["tokens"]), tuple(result["verify_curve"]["seconds"]))
    return curve(9) / curve(1)


def lookup_lines(result: dict[str, Any]) -> list[str]:
    """The demo screen's lines for the prompt-lookup pair: what was decoded and how, then per rule its wall-clock
    speedup over the target alone with its 95 % interval and its tokens' identity with the target alone's."""
    settings, n = result["settings"], result["prompts"]
    families = ", ".join(dict.fromkeys(result.get("families", [])))
    lines = [f"  lookup   prompt lookup as the draft (no draft model, nothing trained): {n} copy-heavy prompts "
             f"({families}) × {result['max_new_tokens']} tokens, T = {result['temperature']:g}, B = 1, {result['threads']} thread, "
             "both sides reading prepacked weights; wall clock here: target alone "
             f"{result['target_alone_tokens_per_s']:.1f} tokens/s; a verify of 9 tokens costs {verify_price(result):.2f} "
             "one-token forwards here (the planners' price)"]
    for rule, row in result["rules"].items():
        name = RULES.get(rule, rule) + (f" ({relative(settings['head'])})" if rule == HEAD_RULE else "")
        lines.append(f"           {name}: {row['speedup']:.2f}×{interval_words(row)}, {row['tokens_per_target_call']:.2f} "
                     f"tokens a target call; tokens the target alone's on {row['same_as_target']} of {n} prompts")
    if settings.get("missing"):
        lines.append(f"           the token head's rule: {settings['missing']}")
    return lines
