"""Wall clock of free drafts (prompt lookup, suffix) against the target alone at B = 1 on this CPU (issue 71, item 6),
rule by rule, per prompt family and overall, with paired 95 % intervals.

    OMP_NUM_THREADS=1 python benchmarks/lookup_decode.py --per-family 3 --temperature 0 \
        --head runs/lookup/train-stop/head --out runs/lookup-wallclock/confirm-t0.json

Each prompt (the first `--per-family` of each `category` of `--prompt-file` after its first `--skip-per-family`,
families taken in turn) is decoded by the target alone (`specheads.eval.wall_clock.target_alone`: one cached forward a
token, its prefill computing the last position's logits only) and then under every rule, back to back, the rules'
order rotated from prompt to prompt, after one short untimed run of each on the first prompt; both sides read the
target's linear weights prepacked once (`specheads.pair.packed`), on one thread (`torch.set_num_threads(1)`; run it
with OMP_NUM_THREADS=1). A rule is:

- `constant_k:K`: prompt lookup (`LookupDraft`, n-gram sizes 3 down to 1, the earliest match), the whole proposal up
  to K verified (vLLM ngram's K in its docs' example is 5, transformers' `prompt_lookup_num_tokens` docs suggest 10).
- `transformers:K`: transformers' own prompt lookup as it runs (`target.generate(prompt_lookup_num_tokens=K)`,
  `max_matching_ngram_size` 2, its default), timed the same way: it pays generate's own overhead.
- `lookup_match:f`, `lookup_table:t`, `lookup_scores:t` (`specheads.decoding.free_rules`) on prompt lookup;
  `suffix_own:p` on SuffixDecoding's suffix drafts (arctic-inference; its global tree keeps the earlier prompts'
  outputs for the process's life, as a server keeps them).
- `lookup_gate:t`: speculate or not per round: the whole proposal (up to `--max-draft`) when vLLM's online table
  expects it to emit more tokens than its verify costs at t a verified token, else a plain target step.
- `lookup_plan:t`: the cost-read planner fed the token-only head `--head` (`specheads.lookup.token_head.TokenHead`);
  `suffix_plan:t` the same planner on SuffixDecoding's drafts read further (`free_replay.SUFFIX_PLAN_DRAFT`), fed
  `--suffix-head`, a token head trained on suffix drafts; `suffix_table:t` vLLM's table on those same drafts (free);
  `lookup_plan_online:t` the same estimates shifted online by what the decode verifies (`specheads.decoding.free_rules`);
  its forwards run inside the timed decode (charged) and are also timed on their own.
The planners (`lookup_table`, `lookup_gate`, `lookup_plan`) price a verify from the target's verify curve, measured
once at the start on this machine as the rules then run (`measure_verify_curve`: one request's forward of n tokens over
the first prompt, prepacked, the sizes timed in turn; kept in the JSON as `verify_curve`, reused on resume); t is
the summary's counted price of a verified token (`PACKED_CPU_TOKEN_COST`), not tuned. Planners that learn online
(vLLM's table) and SuffixDecoding's global trees keep their state from prompt to prompt within a process, as a
server's do, starting cold after the untimed warm-up; a resumed run starts them cold.

Every side pays its own work inside its seconds: the proposal's search (Python, per round), the planner, the head's
forwards, the engine's bookkeeping; the target alone pays a sampler call per token. The JSON (`--out`, rewritten
after every (rule, prompt) finished: run the same command again to resume) keeps each prompt's (tokens, seconds, target
calls, drafted, accepted) per rule; the summary gives per family and overall the geometric-mean speedup over the
target alone with its paired bootstrap 95 % interval, the counted speedup (tokens over target calls priced
1 + t · drafted), the tokens' identity with the target alone's at T = 0, and paired ratios between rules
(`--compare A:B`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from specheads.dataset.prompts import encode_prompt, load_prompts
from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.decoding.free_draft import LookupDraft
from specheads.decoding.free_replay import (
    decoder_rule,
    geometric_speedup,
    head_rule,
    reads_suffix,
    suffix_settings,
)
from specheads.decoding.free_rules import AcceptanceTable, EstimatorPlanned, TablePlanner
from specheads.decoding.verify_curve import free_draft_costs, measure_verify_curve
from specheads.eval.wall_clock import WARM_UP_TOKENS, split_rule, target_alone, timed_forwards
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST
from specheads.lookup.proposers import Proposal
from specheads.lookup.token_head import TokenHead
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, load_model, load_tokenizer, stop_token_ids
from specheads.pair.packed import pack_linear_weights
from specheads.plumbing.dataclass_cli import parse_script
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

PROMPTS = str(Path(__file__).resolve().parent / "prompts" / "lookup-confirm.jsonl")
VLLM_NGRAM_K = 5  # docs.vllm.ai, features/speculative_decoding/n_gram: "num_speculative_tokens": 5
TRANSFORMERS_K = 10  # transformers' generation docs: prompt_lookup_num_tokens, "10 ... a good default"


@dataclass
class LookupBenchmark:
    """What to decode.

    Args:
        target: the target model.
        prompt_file: JSONL of prompts with a `category` (the family).
        per_family: prompts of each family (the first of each after `skip_per_family`, families in turn).
        skip_per_family: prompts of each family passed over first (a run on prompts no earlier run decoded).
        max_new_tokens: tokens per request.
        temperature: the sampling temperature (0: greedy).
        rules: `name:value` rules (module docstring).
        max_draft: the adaptive rules' most proposed tokens a round.
        head: the token-only head folder that `lookup_plan` reads.
        suffix_head: the token-only head folder, trained on suffix drafts, that `suffix_plan` reads.
        compare: `A:B` pairs of rules whose paired ratio the summary gives (A over B).
        resamples: bootstrap resamples of the prompts for the intervals.
        out: the JSON of results (resumed when it exists with the same settings).
        report_only: summarise the runs finished in `out` without decoding more.
        pool: results JSONs of earlier runs under the same settings on other prompts (e.g. `--skip-per-family`), summarised
            together into `out` (a new file), prompt by prompt; with `report_only`.
        decode_only: time each run's decode phase only, its seconds less its decoder's first forward's (the
            prompt's prefill, on every side; the engine's also reads its first round's proposal): at T > 0, where
            the sides emit different numbers of tokens, a run that stops early otherwise pays the same prefill over
            fewer tokens.
    """

    target: str = "embedded:smollm2"
    prompt_file: str = PROMPTS
    per_family: int = 3
    skip_per_family: int = 0
    max_new_tokens: int = 256
    temperature: float = 0.0
    rules: list[str] = field(default_factory=lambda: [
        f"constant_k:{VLLM_NGRAM_K}", f"constant_k:{TRANSFORMERS_K}", f"transformers:{TRANSFORMERS_K}",
        "lookup_match:1.0", "suffix_own:0.1", f"lookup_table:{PACKED_CPU_TOKEN_COST}",
        f"lookup_gate:{PACKED_CPU_TOKEN_COST}"])
    max_draft: int = 16
    head: str | None = None
    suffix_head: str | None = None
    compare: list[str] = field(default_factory=list)
    resamples: int = 1000
    out: str = "runs/lookup-wallclock/results.json"
    report_only: bool = False
    decode_only: bool = False
    pool: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Refuse bad counts, a missing prompt file or head, unknown rules and comparisons of rules not run."""
        for flag, value in (("per_family", self.per_family), ("max_new_tokens", self.max_new_tokens),
                            ("max_draft", self.max_draft), ("resamples", self.resamples)):
            if value < 1:
                raise UsageError(f"--{flag.replace('_', '-')} {value} must be at least 1")
        if self.skip_per_family < 0:
            raise UsageError(f"--skip-per-family {self.skip_per_family} must be at least 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"--temperature {self.temperature} must be a finite number >= 0 (0: greedy)")
        if not Path(self.prompt_file).is_file():
            raise UsageError(f"--prompt-file {self.prompt_file} does not exist; give a JSONL of prompts")
        if len(set(self.rules)) != len(self.rules):
            raise UsageError("--rules names a rule twice; give each once")
        for rule in self.rules:
            make_rule(rule, self.max_draft, None, check_only=True)
        reading = [rule for rule in self.rules if head_rule(rule.split(":")[0]) is not None]
        if any(not reads_suffix(rule) for rule in reading) != bool(self.head):
            raise UsageError("lookup_plan reads the token-only head --head: give both or neither")
        if any(reads_suffix(rule) for rule in reading) != bool(self.suffix_head):
            raise UsageError("suffix_plan reads the token-only head --suffix-head: give both or neither")
        if self.pool and (not self.report_only or Path(self.out).exists()):
            raise UsageError("--pool summarises earlier runs into a new --out with --report-only true; give both")
        for path in self.pool:
            if not Path(path).is_file():
                raise UsageError(f"--pool {path} does not exist; give the results JSON of an earlier run")
        for pair in self.compare:
            if len(pair.split(":")) != 4 or not all(side in self.rules for side in split_pair(pair)):
                raise UsageError(f"--compare {pair!r} is not A:B with A and B two of --rules (e.g. "
                                 "lookup_plan:0.043:constant_k:5)")


def split_pair(pair: str) -> tuple[str, str]:
    """`name:v:name:v` as its two rules."""
    parts = pair.split(":")
    return ":".join(parts[:2]), ":".join(parts[2:])


class GatePlanner(TablePlanner):
    """vLLM's table's estimates, read all or nothing: the whole proposal when its expected tokens pay its verify."""

    def proposal_length(self, row: int, proposal: Proposal, rule: Any) -> int:
        estimates = np.cumprod(self.estimates(row, proposal))
        whole = len(estimates)
        return whole if (1 + estimates.sum()) / self.cost(whole + 1) > 1 else 0


@dataclass(frozen=True)
class SpeculateOrNot(AcceptanceTable):
    """Speculate or not per round (vLLM #52258's ask), from vLLM's online table at a verified token's cost t."""

    name: ClassVar[str] = "lookup_gate"

    def planner(self, costs: ServingCosts | None) -> Any:
        return GatePlanner(self, costs.target if costs is not None else None)


class TimedEstimator:
    """A token head whose every `estimates` call is timed (seconds per call in `seconds`)."""

    def __init__(self, head: TokenHead) -> None:
        self.head, self.seconds = head, []
        self.target_state_size = head.target_state_size

    def estimates(self, proposal: Proposal) -> list[float]:
        began = time.perf_counter()
        estimates = self.head.estimates(proposal)
        self.seconds.append(time.perf_counter() - began)
        return estimates


def make_rule(rule: str, max_draft: int, estimator: Any, check_only: bool = False) -> Any:
    """The stop policy of `rule` (`transformers:K` has none: None); refused in one line when malformed."""
    name, threshold = split_rule(rule, "constant_k:5, lookup_table:0.043")
    if name == "transformers":
        if threshold < 1 or threshold != int(threshold):
            raise UsageError(f"--rules: {rule!r}: transformers' prompt_lookup_num_tokens is a whole number >= 1")
        return None
    if name == "lookup_gate":
        return SpeculateOrNot(threshold=threshold, max_draft=max_draft)
    if head_rule(name) is not None:
        return None if check_only else head_rule(name)(threshold=threshold, max_draft=max_draft, estimator=estimator)
    if name == "constant_k":
        return make_policy(name, threshold, max(int(threshold), 1))
    return make_policy(decoder_rule(name), threshold, max_draft)


def prompt_families(prompt_file: str) -> dict[str, str]:
    """Each prompt id's family (its `category`, else `all`)."""
    with open(prompt_file) as lines:
        return {record["id"]: record.get("category", "all") for record in map(json.loads, filter(str.strip, lines))}


def chosen_prompts(args: LookupBenchmark) -> list[tuple[str, str, Any]]:
    """(id, family, prompt) of `per_family` prompts of each family after its first `skip_per_family`, families taken
    in turn."""
    family = prompt_families(args.prompt_file)
    by_family: dict[str, list[Any]] = {}
    for prompt in load_prompts(args.prompt_file):
        by_family.setdefault(family.get(prompt.id, "all"), []).append(prompt)
    chosen = []
    for index in range(args.skip_per_family, args.skip_per_family + args.per_family):
        chosen += [(group[index].id, name, group[index]) for name, group in by_family.items() if index < len(group)]
    return chosen


def transformers_lookup(target: torch.nn.Module, prompt: list[int], k: int, transform: SamplingTransform,
                        max_new_tokens: int, seed: int, stops: set[int]) -> tuple[list[int], float]:
    """transformers' prompt lookup as it runs (`generate(prompt_lookup_num_tokens=k)`): (tokens, seconds)."""
    sampling = {"do_sample": False} if transform.greedy else {
        "do_sample": True, "temperature": transform.temperature, "top_k": 0, "top_p": 1.0}
    began = time.perf_counter()
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    output = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=k,
                             max_new_tokens=max_new_tokens, eos_token_id=sorted(stops), pad_token_id=min(stops),
                             **sampling)
    return output[0, len(prompt):].tolist(), time.perf_counter() - began


class Runner:
    """The target, its free drafts' engines and each rule's policy and persistent planner."""

    def __init__(self, args: LookupBenchmark, target: torch.nn.Module, stops: set[int],
                 curve: CostCurve | None = None) -> None:
        self.args, self.target, self.stops = args, target, stops
        self.transform = SamplingTransform(args.temperature)
        self.estimator = TimedEstimator(TokenHead.load(args.head, "lookup", 0)) if args.head else None
        self.suffix_estimator = TimedEstimator(TokenHead.load(args.suffix_head, "suffix", 0)) if args.suffix_head else None
        self.engines: dict[str, RoundEngine] = {}
        self.policies = {rule: make_rule(rule, args.max_draft, self.estimator_of(rule)) for rule in args.rules}
        self.costs = None if curve is None else free_draft_costs(curve)
        self.forget()

    def forget(self) -> None:
        """Start every suffix tree and online planner cold: what the untimed warm-up decoded (the first prompt's
        opening tokens) would otherwise be in them when that prompt is timed."""
        self.engines = {key: engine for key, engine in self.engines.items() if not reads_suffix(key)}
        self.planners = {rule: policy.planner(self.costs) for rule, policy in self.policies.items()
                         if policy is not None and isinstance(policy, (AcceptanceTable, EstimatorPlanned))}

    def estimator_of(self, rule: str) -> TimedEstimator | None:
        """The head `rule` reads: trained on the draft kind it reads."""
        return self.suffix_estimator if reads_suffix(rule) else self.estimator

    def engine(self, rule: str) -> RoundEngine:
        """Prompt lookup's engine, shared; each suffix rule its own, so that no rule's global tree holds another
        rule's output of the prompt it decodes."""
        key = rule if reads_suffix(rule) else "ngram"
        if key not in self.engines:
            draft = LookupDraft("suffix", **suffix_settings(rule)) if reads_suffix(rule) else LookupDraft("ngram")
            self.engines[key] = RoundEngine(self.target, draft, self.transform, sorted(self.stops))
        return self.engines[key]

    def alone(self, prompt: list[int], seed: int, tokens: int | None = None) -> dict[str, Any]:
        """The target alone on `prompt`: its record."""
        with timed_forwards(self.target) as forwards, timed_forwards(self.target.base_model) as decoder:
            output, seconds = target_alone(self.target, prompt, self.transform, tokens or self.args.max_new_tokens,
                                           seed, self.stops)
        return {"tokens": len(output), "seconds": seconds, "target_calls": len(forwards),
                "target_seconds": sum(forwards), "prefill_seconds": decoder[0], "drafted": 0, "output": output}

    def run(self, rule: str, prompt: list[int], seed: int, tokens: int | None = None) -> dict[str, Any]:
        """`rule` on `prompt`, timed: its record (tokens, seconds, target calls, drafted, accepted, head seconds)."""
        tokens = tokens or self.args.max_new_tokens
        policy = self.policies[rule]
        estimator = self.estimator_of(rule)
        heads = len(estimator.seconds) if estimator else 0
        if policy is None:
            with timed_forwards(self.target) as forwards, timed_forwards(self.target.base_model) as decoder:
                output, seconds = transformers_lookup(self.target, prompt, int(float(rule.split(":")[1])),
                                                      self.transform, tokens, seed, self.stops)
            record = {"drafted": None, "accepted": None, "target_calls": len(forwards),
                      "target_seconds": sum(forwards)}
        else:
            with timed_forwards(self.target.base_model) as decoder:  # the engine calls the decoder, then lm_head
                result = self.engine(rule).decode([prompt], policy, tokens, [seed], planner=self.planners.get(rule))[0]
            output, seconds = result.tokens, result.seconds
            record = {"drafted": result.drafted, "accepted": result.accepted, "target_calls": result.target_calls,
                      "target_seconds": result.target_seconds}
        record.update(tokens=len(output), seconds=seconds, prefill_seconds=decoder[0], output=output)
        if estimator is not None and head_rule(rule.split(":")[0]) is not None:
            record["head_seconds"], record["head_calls"] = sum(estimator.seconds[heads:]), len(estimator.seconds) - heads
        return record


def rate(record: dict[str, Any], decode_only: bool = False) -> float:
    """Tokens per second of one run (`decode_only`: over its seconds less its prefill's, `LookupBenchmark`)."""
    return record["tokens"] / (record["seconds"] - (record["prefill_seconds"] if decode_only else 0.0))


def counted_cost(record: dict[str, Any]) -> float | None:
    """The run's target calls (`target_calls`, its prefill one of them on every side) priced 1 + t · drafted (t the
    prepacked CPU's verified token, a one-token forward 1); None where the drafted count is unknown (transformers'
    generate)."""
    if record["drafted"] is None:
        return None
    return max(record["target_calls"] + PACKED_CPU_TOKEN_COST * record["drafted"], 1e-9)


def counted_speedup(mine: dict[str, Any], alone: dict[str, Any]) -> float | None:
    """Tokens per counted cost of a rule's run over the target alone's."""
    cost = counted_cost(mine)
    return None if cost is None else (mine["tokens"] / cost) / (alone["tokens"] / counted_cost(alone))


def summarise(runs: dict[str, dict[str, Any]], families: dict[str, str], rules: Sequence[str], greedy: bool,
              resamples: int, decode_only: bool = False) -> dict[str, Any]:
    """Per rule, per family and overall: geometric-mean speedup over the target alone with its paired interval, the
    counted speedup and, at T = 0, the share of prompts whose tokens are the target alone's."""
    summary: dict[str, Any] = {}
    for rule in rules:
        done = [p for p, run in runs.items() if rule in run and "alone" in run]
        row: dict[str, Any] = {}
        for family in sorted({families[p] for p in done}) + ["all"]:
            prompts = [p for p in done if family in ("all", families[p])]
            ratios = np.array([rate(runs[p][rule], decode_only) / rate(runs[p]["alone"], decode_only) for p in prompts])
            mean, interval = geometric_speedup(ratios, resamples)
            counted = [counted_speedup(runs[p][rule], runs[p]["alone"]) for p in prompts]
            counted_mean = None if None in counted else float(np.exp(np.log(counted).mean()))
            row[family] = {"prompts": len(prompts), "speedup": mean, "interval": interval, "counted_speedup": counted_mean,
                           "min": float(ratios.min()), "max": float(ratios.max())}
            if greedy:
                row[family]["same_as_target"] = float(np.mean([runs[p][rule]["output"] == runs[p]["alone"]["output"]
                                                              for p in prompts]))
        heads = [runs[p][rule] for p in done if "head_seconds" in runs[p][rule]]
        if heads:
            row["head_share_of_seconds"] = sum(r["head_seconds"] for r in heads) / sum(r["seconds"] for r in heads)
            row["head_calls"] = sum(r["head_calls"] for r in heads)
        summary[rule] = row
    return summary


def paired(runs: dict[str, dict[str, Any]], families: dict[str, str], mine: str, theirs: str,
           resamples: int, decode_only: bool = False) -> dict[str, Any]:
    """Per family and overall: the geometric mean of `mine`'s tokens/s over `theirs`', prompt by prompt, with its
    bootstrap 95 % interval."""
    done = [p for p, run in runs.items() if mine in run and theirs in run]
    result = {}
    for family in sorted({families[p] for p in done}) + ["all"]:
        ratios = np.array([rate(runs[p][mine], decode_only) / rate(runs[p][theirs], decode_only) for p in done
                           if family in ("all", families[p])])
        mean, interval = geometric_speedup(ratios, resamples)
        result[family] = {"ratio": mean, "interval": interval, "prompts": len(ratios)}
    return result


def settings(args: LookupBenchmark) -> dict[str, Any]:
    """What a resumed run must share with the results it extends."""
    kept = asdict(args)
    for name in ("per_family", "skip_per_family", "compare", "resamples", "out", "rules", "report_only", "decode_only",
                 "pool"):
        kept.pop(name)
    if kept["suffix_head"] is None:  # runs made before suffix_plan existed resume and pool with runs that have none
        kept.pop("suffix_head")
    return kept


def load_results(args: LookupBenchmark) -> dict[str, Any]:
    """The results so far in `args.out` (refused when made under other settings), else an empty set."""
    path = Path(args.out)
    if not path.exists():
        return {"settings": settings(args), "runs": {}}
    results = json.loads(path.read_text())
    if results.get("settings") != settings(args):
        differs = next(k for k in settings(args) if results.get("settings", {}).get(k) != settings(args)[k])
        raise UsageError(f"{args.out} holds results under another --{differs.replace('_', '-')}; give another --out")
    return results


def pooled_results(args: LookupBenchmark) -> dict[str, Any]:
    """The runs of every `--pool` JSON as one set, refused when one was made under other settings, lacks a rule or
    repeats a prompt."""
    pooled: dict[str, Any] = {"settings": settings(args), "runs": {}, "pooled_from": list(args.pool)}
    for path in args.pool:
        results = load_results(replace(args, out=path, pool=[]))
        for pid, run in results["runs"].items():
            missing = [rule for rule in ["alone", *args.rules] if rule not in run]
            if missing or pid in pooled["runs"]:
                why = f"lacks {missing[0]} on {pid}" if missing else f"repeats {pid}"
                raise UsageError(f"--pool {path} {why}; pool runs of other prompts that ran every --rules")
            pooled["runs"][pid] = run
    return pooled


def benchmark(args: LookupBenchmark) -> dict[str, Any]:
    """Decode the chosen prompts by the target alone and under every rule, interleaved, resuming `args.out`."""
    torch.set_num_threads(1)
    if args.pool:
        return report(args, pooled_results(args), prompt_families(args.prompt_file))
    results = load_results(args)
    if args.report_only:
        return report(args, results, {pid: family for pid, family, _ in chosen_prompts(args)})
    spec = ModelSpec(path=args.target)
    tokenizer, target = load_tokenizer(spec), load_model(spec)
    stops = set(stop_token_ids(target, tokenizer))
    packed = pack_linear_weights(target)
    chosen = chosen_prompts(args)
    families = {pid: family for pid, family, _ in chosen}
    encoded = {pid: encode_prompt(tokenizer, prompt) for pid, _, prompt in chosen}
    first = encoded[chosen[0][0]]
    if "verify_curve" not in results:  # measured once: a resumed run plans with the curve its first part read
        curve = measure_verify_curve(target, first)
        results["verify_curve"] = {"tokens": list(curve.tokens), "seconds": list(curve.seconds)}
    curve = CostCurve(tuple(results["verify_curve"]["tokens"]), tuple(results["verify_curve"]["seconds"]))
    print("verify curve (a forward of n tokens over one of 1): " + ", ".join(
        f"{n}: {curve(n) / curve(1):.2f}" for n in curve.tokens), flush=True)
    runner = Runner(args, target, stops, curve)
    runner.alone(first, 0, WARM_UP_TOKENS)
    for rule in args.rules:
        runner.run(rule, first, 0, WARM_UP_TOKENS)
    runner.forget()
    print(f"{len(chosen)} prompts, {args.max_new_tokens} new tokens, T = {args.temperature}, one thread, "
          f"{packed} linear layers prepacked; resuming {sum(map(len, results['runs'].values()))} runs", flush=True)
    for index, (pid, _, _) in enumerate(chosen):
        run = results["runs"].setdefault(pid, {})
        if "alone" not in run:
            run["alone"] = runner.alone(encoded[pid], index)
        turn = index % len(args.rules)
        for rule in args.rules[turn:] + args.rules[:turn]:
            if rule not in run:
                run[rule] = runner.run(rule, encoded[pid], index)
                write_json_atomic(Path(args.out), results)
        print(f"{pid}: " + ", ".join(f"{rule} {rate(run[rule], args.decode_only) / rate(run['alone'], args.decode_only):.2f}x"
                                     for rule in args.rules),
              flush=True)
    return report(args, results, families)


def report(args: LookupBenchmark, results: dict[str, Any], families: dict[str, str]) -> dict[str, Any]:
    """Summarise, print and write the results with their summary."""
    runs = {pid: results["runs"][pid] for pid in families if pid in results["runs"]}
    if args.decode_only and any("prefill_seconds" not in record for run in runs.values() for record in run.values()):
        raise UsageError(f"--decode-only: {args.out} holds runs timed before prefills were recorded; decode them "
                         "again into another --out")
    greedy = args.temperature == 0
    results["summary"] = summarise(runs, families, args.rules, greedy, args.resamples, args.decode_only)
    results["paired"] = {pair: paired(runs, families, *split_pair(pair), args.resamples, args.decode_only)
                         for pair in args.compare}
    for rule, row in results["summary"].items():
        overall = row["all"]
        interval = overall["interval"] or [math.nan, math.nan]
        print(f"{rule}: {overall['speedup']:.3f}x [{interval[0]:.3f}, {interval[1]:.3f}] over {overall['prompts']} "
              "prompts; " + ", ".join(f"{f} {v['speedup']:.2f}x" for f, v in row.items() if isinstance(v, dict)
                                       and f != "all"))
    for pair, row in results["paired"].items():
        interval = row["all"]["interval"] or [math.nan, math.nan]
        print(f"{pair}: {row['all']['ratio']:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]")
    write_json_atomic(Path(args.out), results)
    return results


def main() -> None:
    args = parse_script(LookupBenchmark, "lookup_decode.py", "Free drafts against the target alone at B = 1.")
    benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
