"""Wall clock of a feature drafter (EAGLE-3, DSpark) against the target alone at B = 1, rule by rule, with paired
intervals over prompts: what benchmarks/eagle3_decode.py and benchmarks/dspark_decode.py share.

Each prompt is decoded by the target alone (one cached forward a token, its prefill computing the last position's
logits only, as the engine's does) and, for each rule, by the round engine with the drafter as the draft at B = 1,
every run with the prompt's seed, back to back (`decode_interleaved`: a drift of the machine's speed falls on every
rule alike), after one short untimed run of each on the first prompt (`warm_up`). A rule is `name:threshold` (a chain
rule of `specheads.decoding.rules`, K_max `max_draft`; `head:h` and `head_cost:c` are the stop rules of the trained
head `--head`, which must have trained on data this drafter labelled), or `tree:floor` (a confidence-valued tree of
`tree_budget` nodes, EAGLE-2's).
Per rule: tokens/s, the speedup over the target alone with its 95 % interval over prompts, tokens and draft forwards a
target call (a DSpark block is one forward, each candidate drawn its Markov bias's share of one,
`FeatureDraft.candidate_cost`), the acceptance per drafted position (chains), c = t_draft/t_target as the runs timed
it, for the head's rule its forwards' seconds timed as they ran against the target's and, at T = 0, the share of
prompts whose tokens are the target alone's. The JSON keeps each prompt's (tokens, seconds) per rule and for the target
alone, so a subset (a test half) can be judged afterwards.

Both models' linear layers read weights prepacked once (`specheads.pair.packed`, `packed_weights`), the target
alone's too: without, a verify of K + 1 tokens costs 1.7–1.9 one-token forwards on one CPU thread.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from specheads.artifacts.checkpoint import load_trained
from specheads.dataset.prompts import encode_prompt, load_prompts
from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.drafters import DRAFTER_KINDS, load_feature_draft
from specheads.decoding.engine import check_decodable_head
from specheads.decoding.result import DecodeResult
from specheads.decoding.sampler import draw
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.eval.serving import paired_ratio_interval
from specheads.heads import STOP_PURPOSES
from specheads.heads.base import AcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.drafter_checks import check_drafter_for
from specheads.pair.drafters import labelled_by_drafter
from specheads.pair.models import ModelSpec, load_model, load_tokenizer, stop_token_ids
from specheads.pair.packed import pack_linear_weights
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

CONFIRMATION_PROMPTS = str(Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout_confirm.jsonl")
"""The held-out confirmation prompts (the drafters train on the built-in ones)."""


@dataclass
class DrafterBenchmark:
    """What to decode.

    Args:
        drafter: the drafter folder (speculators' format).
        target: the target model.
        prompt_file: JSONL of prompts.
        prompts: how many of them.
        max_new_tokens: tokens per request.
        rules: `name:threshold` chain rules (`head:h`, `head_cost:c`: the stop rules of `head`) and `tree:floor` trees.
        max_draft: a chain's K_max (a DSpark drafter's block caps it too).
        tree_budget: a tree's nodes a round.
        temperature: the sampling temperature (0: greedy: every rule then gives the target's greedy tokens).
        packed_weights: run both models' linear layers on weights prepacked once (`specheads.pair.packed`; CPU,
            float32), the target alone too.
        resamples: bootstrap resamples of the prompts for the intervals.
        out: a JSON file for the results.
        head: a trained stop head (a `specheads train` checkpoint or run folder, or an exported head) that `head:h`
            and `head_cost:c` rules read; it must have trained on data `specheads gen` labelled with this drafter.
    """

    drafter: str
    target: str = "embedded:smollm2"
    prompt_file: str = CONFIRMATION_PROMPTS
    prompts: int = 40
    max_new_tokens: int = 64
    rules: list[str] = field(default_factory=lambda: ["constant_k:2", "constant_k:3", "constant_k:4", "confidence:0.3",
                                                      "tree:0.1"])
    max_draft: int = 6
    tree_budget: int = 8
    temperature: float = 1.0
    packed_weights: bool = True
    resamples: int = 1000
    out: str | None = None
    head: str | None = None

    def check(self) -> None:
        """Refuse, before any model loads (`specheads.plumbing.dataclass_cli.parse_script`), counts below 1, a
        negative temperature, a missing prompt file and a rule that is not `name:threshold` with a finite threshold
        >= 0 of a known rule (`make_policy`), or `tree:floor`."""
        for flag, value in (("prompts", self.prompts), ("max_new_tokens", self.max_new_tokens),
                            ("max_draft", self.max_draft), ("tree_budget", self.tree_budget), ("resamples", self.resamples)):
            if value < 1:
                raise UsageError(f"--{flag.replace('_', '-')} {value} must be at least 1")
        if self.temperature < 0:
            raise UsageError(f"--temperature {self.temperature} must be at least 0 (0: greedy)")
        if not Path(self.prompt_file).is_file():
            raise UsageError(f"--prompt-file {self.prompt_file} does not exist; give a JSONL of prompts")
        for rule in self.rules:
            name, threshold = split_rule(rule, "confidence:0.3, tree:0.1")
            if name == "tree":
                TreeRule(values="confidence", floor=threshold, budget=self.tree_budget)
            else:
                make_policy(name, threshold, self.max_draft)


def split_rule(rule: str, examples: str) -> tuple[str, float]:
    """`name:value` as (name, value), refused in one line naming `examples` when the value is not a number."""
    name, _, value = rule.partition(":")
    try:
        return name, float(value)
    except ValueError:
        raise UsageError(f"--rules: {rule!r} is not name:threshold (e.g. {examples})") from None


def last_row_only(target: torch.nn.Module) -> dict[str, int]:
    """The forward option that makes `target` compute the logits of its last position only (`logits_to_keep=1`, as
    transformers' `generate` and the round engine do; empty for a model without it)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


@torch.no_grad()
def target_alone(target: torch.nn.Module, prompt: list[int], transform: SamplingTransform, max_new_tokens: int, seed: int,
                 stops: set[int]) -> tuple[list[int], float]:
    """The target's own decoding, one cached forward a token, the prompt's prefill computing its last position's
    logits only (`last_row_only`), as the round engine's does: (tokens, seconds)."""
    began = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=target.config)
    logits = target(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True,
                    **last_row_only(target)).logits[0, -1]
    tokens: list[int] = []
    while True:
        tokens.append(draw(transform.log_probs(logits.float()), generator))
        if len(tokens) >= max_new_tokens or tokens[-1] in stops:
            return tokens, time.perf_counter() - began
        logits = target(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True).logits[0, -1]


def run_rule(engine: RoundEngine, rule: str, prompt: list[int], args: DrafterBenchmark, seed: int,
             head: AcceptanceHead | None = None) -> DecodeResult:
    """One prompt under `rule` (`name:threshold` or `tree:floor`), B = 1; `head` is what a `head:h` rule reads."""
    name, threshold = rule.split(":")
    if name == "tree":
        tree = TreeRule(values="confidence", floor=float(threshold), budget=args.tree_budget)
        return decode_tree(engine, [prompt], tree, args.max_new_tokens, [seed])[0]
    policy = make_policy(name, float(threshold), args.max_draft)
    return engine.decode([prompt], policy, args.max_new_tokens, [seed], head if policy.reads_head else None)[0]


def stop_head(args: DrafterBenchmark, kind: str) -> AcceptanceHead | None:
    """The head that `head:h` and `head_cost:c` rules read (None when no rule reads one), loaded and checked before any model: refused
    without `--head`, with `--head` and no rule reading it, or with a head that is no stop head or trained on data
    another draft labelled (it reads the state of the draft that labelled its data)."""
    policies = {rule: make_policy(rule.split(":")[0], float(rule.split(":")[1]), args.max_draft)
                for rule in args.rules if not rule.startswith("tree:")}
    scaled = [rule for rule, policy in policies.items() if policy.reads_drafter_temperatures]
    if scaled:
        raise UsageError(f"{scaled[0]} reads the drafter's confidence through fitted temperatures, which this benchmark "
                         "does not fit; use its raw form (dspark_confidence), or eval --dspark for the scaled one")
    reading = [rule for rule, policy in policies.items() if policy.reads_head]
    if not reading:
        if args.head:
            raise UsageError(f"--head {args.head} is given but no rule reads it; add a `head:h` rule, e.g. head:0.6, "
                             "or `head_cost:c`")
        return None
    if not args.head:
        raise UsageError(f"the rule {reading[0]} reads a trained head; give --head CHECKPOINT, trained on data "
                         f"`specheads gen --drafter.kind {kind} --drafter.path {args.drafter}` labelled")
    trained = load_trained(args.head)
    if trained.purpose not in STOP_PURPOSES:
        raise UsageError(f"--head {args.head} is a {trained.purpose} head; {reading[0]} decodes a stop head's rule")
    if not labelled_by_drafter((trained.data_identity or {}).get("draft", {}), kind, args.drafter):
        raise UsageError(f"--head {args.head} trained on data labelled by {trained.draft}, not by the "
                         f"{DRAFTER_KINDS[kind]} drafter {args.drafter}, whose state its rule would read; train one on "
                         f"`specheads gen --drafter.kind {kind} --drafter.path {args.drafter}` data")
    check_decodable_head(trained.head)
    for rule in reading:
        policies[rule].check_head(trained.head)
    return trained.head.eval()


@contextmanager
def timed_forwards(module: torch.nn.Module | None) -> Iterator[list[float]]:
    """The seconds of each of `module`'s forwards while inside, timed as they run (none without a module)."""
    seconds: list[float] = []
    if module is None:
        yield seconds
        return
    began: list[float] = []
    hooks = (module.register_forward_pre_hook(lambda *_: began.append(time.perf_counter())),
             module.register_forward_hook(lambda *_: seconds.append(time.perf_counter() - began.pop())))
    try:
        yield seconds
    finally:
        for hook in hooks:
            hook.remove()


def position_counts(results: list[DecodeResult]) -> tuple[list[int], list[int]]:
    """Per drafted position k: (the chain rounds that reached k and accepted its candidate, the rounds that reached k)."""
    reached, accepted = [0] * 64, [0] * 64
    for result in results:
        for drafted, kept in zip(result.drafted_per_round, result.accepted_per_round):
            for k in range(drafted):
                reached[k] += k <= kept
                accepted[k] += k < kept
    depth = sum(1 for r in reached if r)
    return accepted[:depth], reached[:depth]


def shares(accepted: list[int], reached: list[int]) -> list[float]:
    """Per drafted position, the share of the rounds that reached it that accepted its candidate (`position_counts`)."""
    return [round(a / r, 3) for a, r in zip(accepted, reached)]


def rule_row(rule: str, results: dict[int, DecodeResult], baseline: dict[int, list[float]], alone_rate: float,
             resamples: int, head_seconds: list[float], greedy: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """One rule's figures from its runs (keyed by prompt) against the target alone's (`baseline`: tokens, seconds);
    `head_seconds`: each head forward the runs made, as timed; with `greedy` (the target alone's tokens at T = 0), the
    share of prompts whose tokens are the same."""
    mine = {seed: [len(r.tokens), r.seconds] for seed, r in results.items()}
    rate = sum(t for t, _ in mine.values()) / sum(s for _, s in mine.values())
    runs = list(results.values())
    draft_time = sum(r.draft_seconds for r in runs) / max(sum(r.draft_passes for r in runs), 1)
    target_time = sum(r.target_seconds for r in runs) / max(sum(r.target_passes for r in runs), 1)
    calls = max(sum(r.target_calls for r in runs), 1)
    counts = None if rule.startswith("tree:") else position_counts(runs)
    return {"tokens_per_s": rate, "speedup": rate / alone_rate,
            "speedup_interval": paired_ratio_interval(mine, baseline, resamples, 0),
            "tokens_per_target_call": sum(len(r.tokens) for r in runs) / calls,
            "draft_forwards_per_target_call": sum(r.draft_forwards for r in runs) / calls,
            "acceptance_per_position": None if counts is None else shares(*counts),
            "acceptance_counts": None if counts is None else dict(zip(("accepted", "reached"), counts)),
            "timed_cost_ratio": draft_time / target_time if target_time else None,
            "same_as_greedy_target": None if greedy is None else
            sum(r.tokens == greedy[seed] for seed, r in results.items()) / len(results),
            **(head_timing(head_seconds, calls, target_time) if head_seconds else {}),
            "per_prompt": mine}


def head_timing(seconds: list[float], calls: int, target_time: float) -> dict[str, Any]:
    """A head rule's forwards (`seconds`, each as timed): how many a target call, their seconds, and a forward's
    mean seconds against a target forward's (the head's own c)."""
    return {"head_forwards_per_target_call": len(seconds) / calls, "head_seconds": sum(seconds),
            "timed_head_cost_ratio": sum(seconds) / len(seconds) / target_time if target_time else None}


WARM_UP_TOKENS = 4
"""Tokens of each untimed warm-up run (`warm_up`)."""


def warm_up(engine: RoundEngine, prompt: list[int], args: DrafterBenchmark, transform: SamplingTransform,
            stops: set[int], head: AcceptanceHead | None) -> None:
    """One short untimed run of the target alone and of every rule on `prompt` before the first timed one: a first
    forward allocates and picks kernels, which would otherwise fall on the first prompt's target-alone time."""
    short = replace(args, max_new_tokens=min(WARM_UP_TOKENS, args.max_new_tokens))
    target_alone(engine.target, prompt, transform, short.max_new_tokens, 0, stops)
    for rule in args.rules:
        run_rule(engine, rule, prompt, short, 0, head)


def decode_interleaved(engine: RoundEngine, prompts: list[list[int]], args: DrafterBenchmark,
                       transform: SamplingTransform, stops: set[int], head: AcceptanceHead | None
                       ) -> tuple[dict[int, tuple[list[int], float]], dict[str, dict[int, DecodeResult]],
                                  dict[str, list[float]]]:
    """Each prompt decoded by the target alone and then under every rule, back to back, so that a drift of the
    machine's speed over the run (another job, the clock) falls on every rule alike and the paired ratios see it
    as noise, not as a bias between rules run at different times: (the target alone's tokens and seconds per prompt,
    each rule's results per prompt, each rule's head forwards' seconds)."""
    alone: dict[int, tuple[list[int], float]] = {}
    results: dict[str, dict[int, DecodeResult]] = {rule: {} for rule in args.rules}
    head_seconds: dict[str, list[float]] = {rule: [] for rule in args.rules}
    warm_up(engine, prompts[0], args, transform, stops, head)
    for seed, prompt in enumerate(prompts):
        alone[seed] = target_alone(engine.target, prompt, transform, args.max_new_tokens, seed, stops)
        for rule in args.rules:
            with timed_forwards(head) as seconds:
                results[rule][seed] = run_rule(engine, rule, prompt, args, seed, head)
            head_seconds[rule] += seconds
    return alone, results, head_seconds


def benchmark_drafter(args: DrafterBenchmark, kind: str) -> dict[str, Any]:
    """Decode `args.prompts` prompts by the target alone and under each rule with the `kind` drafter of
    `args.drafter` (`specheads.decoding.drafters`), print each rule's line and write `args.out`; the report."""
    head = stop_head(args, kind)
    check_drafter_for(args.drafter, kind, ModelSpec(path=args.target))  # from the target's config: before it loads
    spec = ModelSpec(path=args.target)
    tokenizer, target = load_tokenizer(spec), load_model(spec)
    stops = set(stop_token_ids(target, tokenizer))
    transform = SamplingTransform(args.temperature)
    draft = load_feature_draft(kind, args.drafter, target)
    packed = [pack_linear_weights(model) for model in (target, draft)] if args.packed_weights else [0, 0]
    engine = RoundEngine(target, draft, transform, sorted(stops))
    prompts = [encode_prompt(tokenizer, prompt) for prompt in load_prompts(args.prompt_file, limit=args.prompts)]
    alone, results, head_seconds = decode_interleaved(engine, prompts, args, transform, stops, head)
    baseline = {seed: [len(tokens), seconds] for seed, (tokens, seconds) in alone.items()}
    alone_rate = sum(t for t, _ in baseline.values()) / sum(s for _, s in baseline.values())
    report: dict[str, Any] = {"drafter": args.drafter, "kind": kind, "prompts": len(prompts),
                              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                              "packed_layers": {"target": packed[0], "draft": packed[1]},
                              "target_alone_tokens_per_s": alone_rate, "target_alone_per_prompt": baseline,
                              "rules": {}}
    print(f"target alone: {alone_rate:.1f} tokens/s on {len(prompts)} prompts (prepacked linear layers: target "
          f"{packed[0]}, draft {packed[1]})")
    greedy = {seed: tokens for seed, (tokens, _) in alone.items()} if transform.greedy else None
    if head is not None:
        report["head"] = args.head
    for rule in args.rules:
        row = report["rules"][rule] = rule_row(rule, results[rule], baseline, alone_rate, args.resamples,
                                               head_seconds[rule], greedy)
        interval = row["speedup_interval"]
        print(f"{rule}: {row['tokens_per_s']:.1f} tokens/s, {row['speedup']:.2f}x the target alone"
              + (f" [{1 + interval[0]:.2f}, {1 + interval[1]:.2f}]" if interval else "")
              + f", {row['tokens_per_target_call']:.2f} tokens and {row['draft_forwards_per_target_call']:.2f} draft "
              f"forwards a target call, acceptance per position {row['acceptance_per_position']}, timed c "
              f"{row['timed_cost_ratio'] or float('nan'):.3f}"
              + (f", head c {row['timed_head_cost_ratio']:.3f}" if row.get("timed_head_cost_ratio") else "")
              + ("" if greedy is None else f", the target's greedy tokens on {row['same_as_greedy_target']:.0%} of prompts"))
    if args.out:
        write_json_atomic(Path(args.out), report)
    return report
