"""Decoding runs over held-out prompts: every policy at every threshold, costs, tuning on the dev split.

Each (policy, threshold) runs on every decode prompt; prompts are split into dev (thresholds are tuned
there) and test (what the report quotes). The modelled speedup over target-only decoding is counted, not assumed:
tokens emitted ÷ (c · (draft forwards + h · tokens a head scored) + target calls), in units of one target forward, with
c = t_draft/t_target and h a head forward in draft forwards, its weights over the draft's (`head_forward_cost`; the
shipped on-time head's h is 0.0315); a rule that reads free signals (draft confidence, SVIP, AdaEDL, vLLM's estimator,
D-Cut) reads what the draft computed and pays no such term (`modelled_speedup`, `RunRecord.charged_forwards`). For the
SpecDec++ loop without a head, where every emitted token is an accepted draft token or the one token a target call
yields and the draft makes one forward per drafted token, this equals SpecDec++ Eq. 5.1,
1 / (c·(1 + discard_rate) + (1 − c)·verification_rate) (`eq_5_1_speedup`, quoted only beside the paper), which
leaves the head's forwards out; SPRINTER's loop breaks that assumption (its draft runs for every emitted token and the
target is called besides), so Eq. 5.1 would overstate it. t_draft and t_target are also measured: each model's
forward passes are timed, and the ratio comes with a bootstrap interval that says whether the runs determine it. The
wall-clock figures (tokens/s) time the whole loop, the head's forwards included.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from specheads.decoding import DecodeResult, RoundEngine, make_policy
from specheads.decoding.cache import BatchCache
from specheads.decoding.costs import hindsight_forwards, hindsight_widths
from specheads.decoding.features import draft_block, draft_candidate_cost
from specheads.decoding.online import ADAEDL_GAMMA, SGLANG_START
from specheads.decoding.rules import ONLINE_POLICIES
from specheads.decoding.tree import TreeRule, child_values_refusal, decode_tree
from specheads.eval.likelihood import target_log_likelihoods
from specheads.eval.offline import interval
from specheads.heads import STOP_PURPOSES, AcceptanceHead
from specheads.plumbing.errors import UsageError

HEAD_THRESHOLDS = (0.3, 0.5, 0.65, 0.8, 0.9)
SPRINTER_THRESHOLDS = (0.3, 0.5, 0.7, 0.85)
CONSTANT_KS = (1, 2, 3, 4, 6, 8)
STOP_SHARES = (0.1, 0.25, 0.45, 0.65)  # the share of drafted tokens after which a signal policy stops


@dataclass(frozen=True)
class Setting:
    """One policy at one threshold (K for constant_k)."""

    policy: str
    threshold: float


SAMPLE_SUFFIX = "#sample"  # a test prompt's further samples are decoded as `<id>#sample<s>`


def sample_prompt_id(prompt_id: str, sample: int) -> str:
    """The id sample `sample` (≥ 1) of a test prompt decodes under (sample 0 keeps the prompt's own id)."""
    return f"{prompt_id}{SAMPLE_SUFFIX}{sample}"


def prompt_group(prompt_id: str) -> str:
    """The prompt a decoded id samples: the unit the paired intervals resample, so a prompt's samples move together."""
    return re.sub(rf"{SAMPLE_SUFFIX}\d+$", "", prompt_id)


def grouped_rows(keys: list[str], rows: np.ndarray) -> dict[str, np.ndarray]:
    """`rows` (one per key) summed per `prompt_group` of the key, by group in order of first appearance."""
    groups: dict[str, int] = {}
    index = [groups.setdefault(prompt_group(key), len(groups)) for key in keys]
    summed = np.zeros((len(groups), rows.shape[1]), dtype=np.float64)
    np.add.at(summed, index, rows)
    return dict(zip(groups, summed))


@dataclass(frozen=True)
class DecodePrompt:
    """A held-out prompt to decode: its id, token ids and whether it tunes (dev) or reports (test)."""

    prompt_id: str
    ids: tuple[int, ...]
    split: str


RunKey = tuple[str, float, str]  # policy, threshold, prompt id: a run within one decoding context


@dataclass
class RunRecord:
    """One decoding run's counts."""

    policy: str
    threshold: float
    prompt_id: str
    split: str
    emitted: int
    drafted: int
    accepted: int
    target_calls: int
    draft_forwards: float  # with SV's companion, `companion_forwards` × its cost in draft forwards too
    seconds: float
    forward_seconds: float
    accepted_per_round: list[int]
    target_logprob: float
    reused: bool = False  # taken from an earlier report (eval.reuse), not decoded in this run
    drafted_per_round: list[int] = field(default_factory=list)  # empty in reports from before it was recorded
    draft_seconds: float = 0.0  # time in the draft's forward passes (a batched run's share); 0 in older reports
    target_seconds: float = 0.0
    draft_passes: float = 0.0  # forward passes of the draft (a batched run's share of its batch's)
    target_passes: float = 0.0
    companion_forwards: int = 0  # SV's companion's forwards (0 in older reports)
    draft_widths_per_round: list[list[int]] = field(default_factory=list)  # the tokens of each draft forward per
    # round (DecodeResult's); empty in reports from before chains recorded them
    head_scored: int = 0  # tokens the head scored, and their forwards in draft forwards (DecodeResult's; 0 in reports
    head_forwards: float = 0.0  # from before heads were priced)
    head_widths_per_round: list[list[int]] = field(default_factory=list)  # the tokens scored at each draft forward

    @property
    def charged_forwards(self) -> float:
        """The draft forwards the counted speedup charges: the draft's (with SV's companion's) and the head's."""
        return self.draft_forwards + self.head_forwards


def signal_thresholds(entropy: np.ndarray, prob: np.ndarray, shares: Iterable[float] | None = None,
                      top1: np.ndarray | None = None) -> dict[str, list[float]]:
    """SVIP, confidence, AdaEDL (its starting λ) and, given the draft's `top1`, llama.cpp's p_min thresholds at which
    each signal stops after about `shares` (default STOP_SHARES) of drafted tokens."""
    shares = STOP_SHARES if shares is None else tuple(shares)
    root_entropy = np.sqrt(np.clip(entropy, 0, None))
    bound = 1.0 - np.sqrt(ADAEDL_GAMMA) * root_entropy
    grid = {"svip": [round(float(np.quantile(root_entropy, 1 - s)), 4) for s in shares],
            "confidence": [round(float(np.quantile(prob, s)), 4) for s in shares],
            "adaedl": [round(float(np.quantile(bound, s)), 4) for s in shares]}
    if top1 is not None:
        grid["pmin"] = [round(float(np.quantile(top1, s)), 4) for s in shares]
    return grid


APPROXIMATE_POLICIES = ("sprinter",)
"""Rules whose output is not the target's distribution: their sweeps score every run under the target."""

TRANSFORMERS_THRESHOLD = 0.4
"""transformers' assistant_confidence_threshold default: its rule starts there and re-tunes itself at run time."""
TRANSFORMERS_HEURISTIC_START = 5
"""num_assistant_tokens of transformers' older default `heuristic` schedule: its K starts there and moves at run time."""
FIXED_SETTINGS = {"transformers": TRANSFORMERS_THRESHOLD, "transformers_heuristic": float(TRANSFORMERS_HEURISTIC_START),
                  "sglang_adaptive": float(SGLANG_START)}
"""The rules users get with their defaults, nothing to tune: each is decoded at its default alone."""


def default_settings(purpose: str, signal_grid: dict[str, list[float]], max_draft: int,
                     head_thresholds: Iterable[float] | None = None, sprinter_thresholds: Iterable[float] | None = None,
                     constant_ks: Iterable[int] | None = None, companion: bool = False,
                     drafter_scores: bool = False, drafter_temperatures: bool = False) -> list[Setting]:
    """The sweep for a head of `purpose`: constant K, SVIP, confidence, the field's free rules, SV's companion
    predictor where a companion runs (`companion`), p_min on a DSpark drafter's confidence where the draft makes
    one (`drafter_scores`, at the head's thresholds; through its temperatures too where they were fitted,
    `drafter_temperatures`), the head and the oracle (stop heads), or constant K beside the
    SPRINTER loop (verifiers)."""
    head_thresholds = HEAD_THRESHOLDS if head_thresholds is None else head_thresholds
    sprinter_thresholds = SPRINTER_THRESHOLDS if sprinter_thresholds is None else sprinter_thresholds
    ks = sorted(set(constant_ks)) if constant_ks else sorted({k for k in CONSTANT_KS if k <= max_draft} | {max_draft})
    settings = [Setting("constant_k", float(k)) for k in ks]
    if purpose in STOP_PURPOSES:
        settings += [Setting(name, t) for name in ("svip", "confidence") for t in signal_grid[name]]
        settings += [Setting("adaedl", t) for t in signal_grid["adaedl"]]  # λ starts at SVIP's stop shares
        settings += [Setting("vllm_online", t) for t in head_thresholds]  # 1 − Π p_k > h, as the head's rule
        settings += [Setting(policy, t) for policy in ("vllm_current", "vllm_margin", "vllm_history") for t in head_thresholds]
        settings += [Setting("pmin", t) for t in signal_grid.get("pmin", ())]  # max q < p_min, at the stop shares
        settings += [Setting(policy, value) for policy, value in FIXED_SETTINGS.items()]
        if companion:
            settings += [Setting("sv_companion", t) for t in head_thresholds]  # 1 − Π p̂_k > h, as the head's rule
        if drafter_scores:
            settings += [Setting("dspark_confidence", t) for t in head_thresholds]  # its confidence < p_min
        if drafter_scores and drafter_temperatures:
            settings += [Setting("dspark_confidence_ts", t) for t in head_thresholds]
        settings += [Setting("head", t) for t in head_thresholds]
        settings.append(Setting("oracle", float(max_draft)))
    else:
        settings += [Setting("sprinter", t) for t in sprinter_thresholds]
    return settings


def as_oracle(record: RunRecord, block: int | None = None, candidate_cost: float = 0.0) -> RunRecord:
    """The hindsight oracle's accounting of a constant-K_max run (the same tokens): it drafts only the candidates the
    target accepts, one draft forward each (the first reading the run's catch-up), or one block a round that keeps
    any for a draft of forward shape `block` (`specheads.decoding.costs.hindsight_forwards`), with `candidate_cost` for
    each kept candidate (a DSpark drafter's Markov bias), and calls the target as often."""
    widths = hindsight_widths(record.draft_widths_per_round, record.accepted_per_round, block)
    return replace(record, policy="oracle", drafted=record.accepted, drafted_per_round=list(record.accepted_per_round),
                   draft_forwards=hindsight_forwards(record.accepted_per_round, block, candidate_cost),
                   draft_widths_per_round=widths)


def record_of(setting: Setting, prompt: DecodePrompt, result: DecodeResult, logprob: float) -> RunRecord:
    """A run's counts as a record."""
    return RunRecord(setting.policy, setting.threshold, prompt.prompt_id, prompt.split, result.emitted, result.drafted,
                     result.accepted, result.target_calls, result.draft_forwards, result.seconds, result.forward_seconds,
                     list(result.accepted_per_round), logprob, drafted_per_round=list(result.drafted_per_round),
                     draft_seconds=result.draft_seconds, target_seconds=result.target_seconds,
                     draft_passes=result.draft_passes, target_passes=result.target_passes,
                     companion_forwards=result.companion_forwards,
                     draft_widths_per_round=[list(widths) for widths in result.draft_widths_per_round],
                     head_scored=result.head_scored, head_forwards=result.head_forwards,
                     head_widths_per_round=[list(widths) for widths in result.head_widths_per_round])


def decode_runs(engine: RoundEngine, setting: Setting, prompts: list[DecodePrompt], seeds: list[int],
                head: AcceptanceHead, max_new_tokens: int, max_draft: int, planner: Any = None,
                likelihood: bool = True) -> list[RunRecord]:
    """Decode prompts together under one setting (`specheads.decoding`: one round engine for every rule and B);
    `planner` carries a run-time adapting rule's state over from the setting's earlier batches. `likelihood`: score
    each output under the target (one more target forward per batch; NaN when not asked)."""
    ids = [list(prompt.ids) for prompt in prompts]
    tree = tree_policy(setting.policy)
    if tree is not None:  # the prompts' trees verified together, a draft forward over a tree's nodes counting as one
        tree_rule = tree.rule(setting.threshold)
        results = decode_tree(engine, ids, tree_rule, max_new_tokens, seeds, head if tree_rule.reads_head else None,
                              batch_size=len(ids))
        return [record_of(setting, prompt, result, math.nan) for prompt, result in zip(prompts, results)]
    rule = make_policy(setting.policy, setting.threshold, max_draft)
    results = engine.decode(ids, rule, max_new_tokens, seeds, head if rule.reads_head else None, planner=planner)
    likelihoods = (target_log_likelihoods(engine.target, ids, [result.tokens for result in results]) if likelihood
                   else [math.nan] * len(results))
    return [record_of(setting, prompt, result, likelihood)
            for prompt, result, likelihood in zip(prompts, results, likelihoods)]


def reads_head(setting: Setting, max_draft: int) -> bool:
    """Whether the setting's rule (or tree) reads the evaluated head."""
    tree = tree_policy(setting.policy)
    if tree is not None:
        return tree.rule(setting.threshold).reads_head
    return make_policy(setting.policy, setting.threshold, max_draft).reads_head


def head_free(settings: list[Setting], max_draft: int) -> list[Setting]:
    """The settings whose rules read no head (a feature drafter's eval: the head read another draft's state)."""
    return [setting for setting in settings if not reads_head(setting, max_draft)]


def decoded_settings(settings: list[Setting], max_draft: int) -> list[Setting]:
    """The settings a sweep decodes: all but the oracle, which is read off the constant K_max runs (added if absent)."""
    real = [s for s in settings if s.policy != "oracle"]
    if any(s.policy == "oracle" for s in settings) and Setting("constant_k", float(max_draft)) not in real:
        real.append(Setting("constant_k", float(max_draft)))
    return real


def run_sweep(engine: RoundEngine, prompts: list[DecodePrompt], settings: list[Setting], head: AcceptanceHead,
              max_new_tokens: int, max_draft: int, seed: int = 0, progress: bool = True,
              reused: dict[RunKey, RunRecord] | None = None, batch_size: int = 1,
              finished: dict[RunKey, RunRecord] | None = None,
              on_batch: Callable[[list[RunRecord]], None] | None = None) -> list[RunRecord]:
    """Decode every prompt under every setting, `batch_size` prompts at a time (the oracle is read off the constant
    K_max runs); a run found in `reused` (keyed by policy, threshold and prompt id; eval.reuse) or in `finished` (runs
    an interrupted sweep of this context decoded; eval.journal) is taken from there instead. `on_batch` receives
    each batch of runs as it finishes. Prompt number i is decoded with seed `seed · 1 000 003 + i` whatever the
    batch it sits in."""
    taken = {**(finished or {}), **(reused or {})}
    records: list[RunRecord] = []
    real = decoded_settings(settings, max_draft)
    # the target log-likelihood is the quality proxy of an approximate rule (SPRINTER) against exact SD with constant K;
    # the constant-K runs are always scored (one target forward a batch), so that a verifier's eval that takes them
    # from a stop head's (--reuse-runs) still has the exact reference; other exact rules' text is the target's own
    oracle_wanted = any(s.policy == "oracle" for s in settings)
    bar = tqdm(total=len(real) * len(prompts), desc="decoding runs", unit="run", disable=not progress)
    for setting in real:
        earlier = {number: taken.get((setting.policy, setting.threshold, prompt.prompt_id))
                   for number, prompt in enumerate(prompts)}
        if setting.policy in ONLINE_POLICIES and None in earlier.values():
            # a rule that adapts at run time learns from the setting's earlier runs: a partly finished setting is
            # decoded again from its start, so that its runs are the ones an uninterrupted sweep decodes
            earlier = dict.fromkeys(earlier)
        todo = [number for number in range(len(prompts)) if earlier[number] is None]
        decoded: dict[int, RunRecord] = {}
        # a rule that adapts at run time keeps learning over the setting's batches, as in one long-running server
        planner = make_policy(setting.policy, setting.threshold, max_draft).planner(None) \
            if setting.policy in ONLINE_POLICIES else None
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            runs = decode_runs(engine, setting, [prompts[n] for n in chunk], [seed * 1_000_003 + n for n in chunk],
                               head, max_new_tokens, max_draft, planner,
                               setting.policy in ("constant_k", *APPROXIMATE_POLICIES))
            decoded.update(zip(chunk, runs))
            if on_batch is not None:
                on_batch(runs)
            bar.update(len(chunk))
        bar.update(len(prompts) - len(todo))
        for number, prompt in enumerate(prompts):
            record = replace(earlier[number], split=prompt.split) if earlier[number] is not None else decoded[number]
            records.append(record)
            if oracle_wanted and setting == Setting("constant_k", float(max_draft)):
                records.append(as_oracle(record, draft_block(engine.draft), draft_candidate_cost(engine.draft)))
    bar.close()
    return records


RATIO_SPREAD_LIMIT = 1.5
"""A measured t_draft/t_target whose 95 % interval spans more than this factor (upper / lower) is marked unreliable."""
MIN_TIMED_PASSES = 20
"""Fewer forward passes of either model than this and the measured ratio is marked unreliable."""


def measure_costs(records: list[RunRecord], resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """t_draft and t_target (seconds per forward pass, timed around each model's forwards) in the runs decoded here
    (not those reused from an earlier report), their ratio, and how well the runs determine it.

    `ratio_ci` is a 95 % bootstrap interval that resamples settings (a setting's rows share their batches' passes);
    `reliable` is false when that interval spans more than RATIO_SPREAD_LIMIT or either model made fewer than
    MIN_TIMED_PASSES passes, with the reason in `caveat`. Where a model made no forward at all, its time and the ratio
    are None and `undetermined` says why."""
    real = [r for r in records if r.policy != "oracle" and not r.reused]
    wall = max(sum(r.seconds for r in real), 1e-9)
    costs: dict[str, Any] = {"t_draft_s": None, "t_target_s": None, "ratio": None, "ratio_ci": None, "reliable": False,
                             "caveat": None, "undetermined": None, "draft_passes": 0.0, "target_passes": 0.0,
                             "loop_overhead_share": 1.0 - sum(r.draft_seconds + r.target_seconds for r in real) / wall}
    times = np.array([[r.draft_seconds, r.draft_passes, r.target_seconds, r.target_passes] for r in real],
                     dtype=np.float64).reshape(-1, 4)
    totals = times.sum(axis=0)
    costs["draft_passes"], costs["target_passes"] = float(totals[1]), float(totals[3])
    if totals[1] > 0:
        costs["t_draft_s"] = float(totals[0] / totals[1])
    if totals[3] > 0:
        costs["t_target_s"] = float(totals[2] / totals[3])
    if costs["t_draft_s"] is None or costs["t_target_s"] is None:
        costs["undetermined"] = ("no run decoded here made a forward" if costs["t_draft_s"] == costs["t_target_s"]
                                 else "no run decoded here called the target" if costs["t_target_s"] is None
                                 else "no run decoded here made a draft forward")
        return costs
    costs["ratio"] = costs["t_draft_s"] / costs["t_target_s"]
    costs["ratio_ci"] = interval = ratio_interval(real, times, resamples, seed)
    if min(totals[1], totals[3]) < MIN_TIMED_PASSES:
        costs["caveat"] = f"only {int(min(totals[1], totals[3]))} forward passes of one model were timed"
    elif interval is None or interval[0] <= 0 or interval[1] / interval[0] > RATIO_SPREAD_LIMIT:
        costs["caveat"] = "its 95 % interval over settings is wide: the forward times vary too much between settings"
    costs["reliable"] = costs["caveat"] is None
    return costs


def ratio_interval(records: list[RunRecord], times: np.ndarray, resamples: int, seed: int) -> list[float] | None:
    """95 % bootstrap interval of t_draft/t_target, resampling settings with their runs (None when too few
    resamples time both models)."""
    settings = sorted({(r.policy, r.threshold) for r in records})
    groups = np.array([settings.index((r.policy, r.threshold)) for r in records])
    per_setting = np.stack([times[groups == g].sum(axis=0) for g in range(len(settings))])
    rng = np.random.default_rng(seed)
    picked = per_setting[rng.integers(0, len(settings), size=(resamples, len(settings)))].sum(axis=1)
    usable = picked[(picked[:, 1] > 0) & (picked[:, 3] > 0) & (picked[:, 2] > 0)]
    if len(usable) < resamples // 2:
        return None
    ratios = (usable[:, 0] / usable[:, 1]) / (usable[:, 2] / usable[:, 3])
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def modelled_speedup(emitted: Any, draft_forwards: Any, target_calls: Any, cost_ratio: float) -> Any:
    """Speedup over target-only decoding from what a run counted: tokens emitted ÷ (c · draft forwards + target
    calls), in target-forward units with c = t_draft/t_target = `cost_ratio` (floats or arrays); `draft_forwards` are
    the charged ones, the head's forwards included (`RunRecord.charged_forwards`)."""
    return emitted / (cost_ratio * draft_forwards + target_calls)


def measured_speedup(emitted: float, draft_forwards: float, target_calls: float,
                     measured_ratio: float | None) -> float | None:
    """The counted speedup at the ratio measured on this machine; None where the runs did not determine the ratio,
    or where it models no time at all (a zero ratio and no target call)."""
    if measured_ratio is None or measured_ratio * draft_forwards + target_calls <= 0:
        return None
    return modelled_speedup(emitted, draft_forwards, target_calls, measured_ratio)


def eq_5_1_speedup(discard_rate: Any, verification_rate: Any, cost_ratio: float) -> Any:
    """SpecDec++ Eq. 5.1, 1 / (c·(1 + discard_rate) + (1 − c)·verification_rate): equal to `modelled_speedup` for the
    SpecDec++ loop without a head (module docstring; it leaves a head's forwards out), quoted only beside the paper's
    figures."""
    return 1.0 / (cost_ratio * (1.0 + discard_rate) + (1.0 - cost_ratio) * verification_rate)


def aggregate(records: list[RunRecord], split: str | None, cost_ratio: float,
              measured_ratio: float | None) -> list[dict[str, Any]]:
    """Per setting over the prompts of `split` (None: all): rates as ratios of totals, and the speedups."""
    chosen = [r for r in records if split is None or r.split == split]
    rows = []
    for setting in dict.fromkeys(Setting(r.policy, r.threshold) for r in chosen):
        runs = [r for r in chosen if (r.policy, r.threshold) == (setting.policy, setting.threshold)]
        emitted = sum(r.emitted for r in runs)
        calls = sum(r.target_calls for r in runs)
        forwards = sum(r.charged_forwards for r in runs)
        discard = sum(r.drafted - r.accepted for r in runs) / emitted
        verification = calls / emitted
        logprobs = [r.target_logprob for r in runs if math.isfinite(r.target_logprob)]
        rows.append({
            "policy": setting.policy, "threshold": setting.threshold,
            "prompts": len({prompt_group(r.prompt_id) for r in runs}), "runs": len(runs), "tokens": emitted,
            "discard_rate": discard, "verification_rate": verification, "draft_forwards_per_token": forwards / emitted,
            "head_forwards_per_token": sum(r.head_forwards for r in runs) / emitted,
            "mean_accepted_length": sum(r.accepted for r in runs) / max(sum(len(r.accepted_per_round) for r in runs), 1),
            "tokens_per_target_call": emitted / max(calls, 1),
            "tokens_per_s": emitted / sum(r.seconds for r in runs), "wall_s": sum(r.seconds for r in runs),
            "modelled_speedup": modelled_speedup(emitted, forwards, calls, cost_ratio),
            "modelled_speedup_measured_ratio": measured_speedup(emitted, forwards, calls, measured_ratio),
            "mean_target_logprob": float(np.mean(logprobs)) if logprobs else None,
        })
    return rows


def paired_gain_interval(records: list[RunRecord], mine: Setting, other: Setting, cost_ratio: float,
                         resamples: int = 1000, seed: int = 0, split: str = "test") -> list[float] | None:
    """95 % interval of `mine`'s modelled speedup over `other`'s, minus 1, resampling the split's prompts with
    replacement (paired: each resample draws the same prompts for both; counts are summed over the drawn prompts,
    as in `aggregate`; a prompt's samples, `prompt_group`, are drawn together). None when fewer than two prompts ran
    under both."""
    def per_prompt(setting: Setting) -> dict[str, RunRecord]:
        return {r.prompt_id: r for r in records
                if r.split == split and (r.policy, r.threshold) == (setting.policy, setting.threshold)}

    runs_a, runs_b = per_prompt(mine), per_prompt(other)
    prompts = sorted(set(runs_a) & set(runs_b))

    def per_group(runs: dict[str, RunRecord]) -> np.ndarray:  # [prompts, 3]: emitted, draft forwards, target calls
        table = np.array([[runs[p].emitted, runs[p].charged_forwards, runs[p].target_calls] for p in prompts],
                         dtype=np.float64).reshape(-1, 3)
        return np.array(list(grouped_rows(prompts, table).values())).reshape(-1, 3)

    counts = {"a": per_group(runs_a), "b": per_group(runs_b)}
    groups = len(counts["a"])
    if groups < 2 or resamples < 1:
        return None
    draws = np.random.default_rng(seed).integers(0, groups, (resamples, groups))
    speedups = {}
    for name, table in counts.items():
        emitted, forwards, calls = (table[:, column][draws].sum(1) for column in range(3))
        speedups[name] = modelled_speedup(emitted, forwards, calls, cost_ratio)
    return interval(list(speedups["a"] / speedups["b"] - 1.0))


def tune(dev_rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, the dev row with the highest modelled speedup (the tuned threshold)."""
    best: dict[str, dict[str, Any]] = {}
    for row in dev_rows:
        if row["policy"] not in best or row["modelled_speedup"] > best[row["policy"]]["modelled_speedup"]:
            best[row["policy"]] = row
    return best


def grid_edges(dev_rows: list[dict[str, Any]], tuned: dict[str, float]) -> dict[str, str]:
    """Per policy whose tuned threshold is the lowest or highest of its dev grid (of two or more), which end:
    the best may lie beyond it. Constant K's lower end, K = 1, is not an edge: nothing lies below it."""
    edges: dict[str, str] = {}
    for policy, threshold in tuned.items():
        grid = sorted({row["threshold"] for row in dev_rows if row["policy"] == policy})
        if len(grid) < 2:  # the oracle's single K_max
            continue
        if threshold == grid[-1]:
            edges[policy] = "highest"
        elif threshold == grid[0] and not (policy == "constant_k" and threshold <= 1):
            edges[policy] = "lowest"
    return edges


def records_as_dicts(records: list[RunRecord]) -> list[dict[str, Any]]:
    """Plain dicts for JSON."""
    return [asdict(r) for r in records]


# ---- tree drafts (docs/method.md "Tree drafts"): decoding policies beside the chain's, each prompt decoded alone

TREE_FLOORS = (0.05, 0.1, 0.2, 0.3, 0.45)
"""The floors the tuned trees sweep on dev prompts (on the embedded pair at N = 8 the best were 0.1 with confidence
values and 0.3 with head values; docs/results.md "Tree drafts")."""
TREE_WIDTH = TREE_EXPAND = 4
"""Most children per node and most nodes the draft reads per forward, as benchmarks/tree_drafts.py decodes them."""
TREE_KINDS = ("tree_head", "tree_confidence")
"""The trees whose floor is tuned on dev prompts; --fixed-thresholds gives each one floor for every budget N."""
TREE_AGAINST = ("head", "constant_k")
"""The chain rules every tree is compared with, each at its tuned threshold: the head's stop rule and constant K."""
TREE_COUNTING = ("a draft forward over a tree's nodes counts as one draft forward; every node a head valued costs a head "
                 "forward; the target verifies a tree in one call")
_TREE_NAME = re.compile(r"tree_(head|confidence)(_cost)?_n([1-9][0-9]*)")


@dataclass(frozen=True)
class TreePolicy:
    """A tree as a decoding policy of the sweep: its values (`head`: the head's â; `confidence`: q(x), EAGLE-2's), its
    node budget N and its growth (`weighs_costs`: read from the costs at c, floor 0, tuned nowhere; otherwise a floor
    tuned on dev prompts). Its policy name carries all three (`tree_head_n8`, `tree_confidence_cost_n8`); the
    setting's threshold is the floor, or c for a tree grown by the costs."""

    values: str
    budget: int
    weighs_costs: bool

    @property
    def kind(self) -> str:
        """`tree_head`, `tree_confidence`, `tree_head_cost` or `tree_confidence_cost`: the policy without N."""
        return f"tree_{self.values}" + ("_cost" if self.weighs_costs else "")

    @property
    def name(self) -> str:
        """The policy name the sweep's records carry."""
        return f"{self.kind}_n{self.budget}"

    def rule(self, threshold: float) -> TreeRule:
        """The tree rule of this policy's setting at `threshold` (the floor, or c)."""
        if self.weighs_costs:
            return TreeRule(self.values, 0.0, self.budget, TREE_WIDTH, TREE_EXPAND, cost_ratio=threshold)
        return TreeRule(self.values, threshold, self.budget, TREE_WIDTH, TREE_EXPAND)

    def growth(self, threshold: float) -> str:
        """How the tree's shape was chosen, in words."""
        return f"read from the costs at c = {threshold:g}" if self.weighs_costs else f"floor {threshold:g}"


def tree_policy(policy: str) -> TreePolicy | None:
    """The tree a sweep policy name stands for; None for a chain rule."""
    match = _TREE_NAME.fullmatch(policy)
    return None if match is None else TreePolicy(match[1], int(match[3]), match[2] is not None)


def is_tree(policy: str) -> bool:
    """Whether a sweep policy is a tree draft."""
    return tree_policy(policy) is not None


def tree_head_refusal(head: AcceptanceHead, purpose: str) -> str | None:
    """Why the head cannot value a tree's children (None: it can): a tree scores each child from its parent's state
    when the child is drawn, which only an acceptance head deciding at the draw or before it does."""
    if purpose not in STOP_PURPOSES:
        return (f"a {head.head_type} head predicts whether a token may pass unverified, not a child's acceptance "
                "min(1, p/q): only the confidence-valued trees are decoded")
    refusal = child_values_refusal(head)
    if refusal:
        return (f"{refusal}: only the confidence-valued trees are decoded; train an on-time head "
                "(configs/train/specdecpp-ontime.yaml) for head values")
    return None


def tree_settings(budgets: Iterable[int], head: AcceptanceHead, purpose: str, cost_ratio: float,
                  floors: Iterable[float] | None = None, given: dict[str, float] | None = None,
                  given_by: str = "--fixed-thresholds",
                  head_left_out: str | None = None) -> tuple[list[Setting], dict[str, str]]:
    """The tree settings of a sweep, and the trees left out with why: for each budget N, the head-valued tree (when
    the head can value children, `tree_head_refusal`, and its rules are decoded: `head_left_out` says why not) and
    the confidence-valued tree at each floor of `floors`
    (TREE_FLOORS by default; tuned on dev prompts afterwards), or at the one floor `given` for it (keyed by policy
    name, `tree_head_n8`, or by kind, `tree_head`, for every N) by `given_by`; and both grown by the costs at
    `cost_ratio` (floor 0, tuned nowhere)."""
    refusal = head_left_out or tree_head_refusal(head, purpose)
    sources = ("confidence",) if refusal else ("head", "confidence")
    settings = []
    for budget in dict.fromkeys(budgets):
        for values in sources:
            tuned = TreePolicy(values, budget, False)
            if given is None:
                settings += [Setting(tuned.name, float(floor)) for floor in (TREE_FLOORS if floors is None else floors)]
            else:
                floor = given.get(tuned.name, given.get(tuned.kind))
                if floor is None:
                    raise UsageError(f"{given_by} has no floor for the {values}-valued tree at N = {budget} "
                                     f"({tuned.kind}); give one there, or drop {budget} from --tree-budgets")
                settings.append(Setting(tuned.name, float(floor)))
            settings.append(Setting(TreePolicy(values, budget, True).name, cost_ratio))
    return settings, ({"tree_head": refusal} if refusal else {})


def check_tree_pair(engine: RoundEngine, head: AcceptanceHead) -> None:
    """Refuse, before any forward, a pair that `decode_tree` cannot decode (a draft of another vocabulary, a cache
    that is not one tensor per layer), so that a sweep asked for trees does not stop at its first tree."""
    if engine.vocabulary != engine.draft_vocabulary:
        raise UsageError(f"tree drafts need a draft that predicts the target's {engine.vocabulary} tokens; this draft "
                         f"predicts {engine.draft_vocabulary}: drop --tree-budgets, or pick a draft with the target's "
                         "vocabulary")
    for name, model in (("draft", engine.draft), ("target", engine.target)):
        if not BatchCache(model, 1, head.state_layer if name == "draft" else None).plain_layers():
            raise UsageError(f"tree drafts need a {name} whose KV cache is one tensor per layer (a tree mask would "
                             "bypass sliding-window or recurrent layers); drop --tree-budgets for this pair")


def setting_speedups(records: list[RunRecord], setting: Setting, cost_ratio: float,
                     split: str = "test") -> tuple[float, float] | None:
    """A setting's modelled speedup and tokens per target call over the split's runs (None without runs)."""
    runs = [r for r in records if r.split == split and (r.policy, r.threshold) == (setting.policy, setting.threshold)]
    if not runs:
        return None
    emitted, calls = sum(r.emitted for r in runs), sum(r.target_calls for r in runs)
    return modelled_speedup(emitted, sum(r.charged_forwards for r in runs), calls, cost_ratio), emitted / max(calls, 1)


def tree_section(records: list[RunRecord], budgets: Iterable[int], chain_tuned: dict[str, float], cost_ratio: float,
                 measured_ratio: float | None, given: dict[str, float] | None = None, resamples: int = 1000,
                 seed: int = 0, left_out: dict[str, str] | None = None,
                 floors: Iterable[float] | None = None) -> dict[str, Any]:
    """metrics.json's `decoding.trees`: every tree setting on test prompts (`policies`, the tuned floors marked) and
    dev prompts, the floors tuned on dev (or `given`, as `tree_settings` took them) and those at an end of their
    grid, and each tuned tree against the chain rules at their tuned thresholds (`chain_tuned`: the head's stop rule
    and constant K) and, for a head-valued tree, against the confidence-valued tree of the same N and growth: the
    gain in modelled speedup at `cost_ratio` with its paired 95 % interval over test prompts, and the gain in tokens
    per target call."""
    trees = [r for r in records if is_tree(r.policy)]
    dev = aggregate(trees, "dev", cost_ratio, measured_ratio)
    test = aggregate(trees, "test", cost_ratio, measured_ratio)
    policies = {policy: tree_policy(policy) for policy in dict.fromkeys(r.policy for r in trees)}
    if given is None:
        tuned = {policy: row["threshold"] for policy, row in tune([r for r in dev if not policies[r["policy"]].weighs_costs]).items()}
        edges = grid_edges(dev, tuned)
    else:
        tuned = {policy: float(given.get(policy, given.get(tree.kind, math.nan))) for policy, tree in policies.items()
                 if not tree.weighs_costs}
        edges = {}
    tuned.update({policy: cost_ratio for policy, tree in policies.items() if tree.weighs_costs})
    for row in (*dev, *test):
        tree = policies[row["policy"]]
        row.update(values=tree.values, budget=tree.budget, growth="costs" if tree.weighs_costs else "floor",
                   draft_forwards_per_target_call=row["draft_forwards_per_token"] * row["tokens_per_target_call"])
    for row in test:
        row["tuned"] = tuned.get(row["policy"]) == row["threshold"]
    gains = []
    for policy, threshold in tuned.items():
        tree = policies[policy]
        against = [(chain, chain_tuned[chain]) for chain in TREE_AGAINST if chain in chain_tuned]
        twin = TreePolicy("confidence", tree.budget, tree.weighs_costs).name
        if tree.values == "head" and twin in tuned:
            against.append((twin, tuned[twin]))
        mine = setting_speedups(records, Setting(policy, threshold), cost_ratio)
        for other, other_threshold in against:
            theirs = setting_speedups(records, Setting(other, other_threshold), cost_ratio)
            if mine is None or theirs is None:
                continue
            gains.append({"policy": policy, "budget": tree.budget, "against": other, "against_threshold": other_threshold,
                          "speedup_gain": mine[0] / theirs[0] - 1,
                          "speedup_gain_ci": paired_gain_interval(records, Setting(policy, threshold),
                                                                  Setting(other, other_threshold), cost_ratio,
                                                                  resamples, seed),
                          "tokens_per_target_call_gain": mine[1] / theirs[1] - 1})
    return {"budgets": list(dict.fromkeys(budgets)), "width": TREE_WIDTH, "expand": TREE_EXPAND,
            "floors": None if given is not None else list(TREE_FLOORS if floors is None else floors),
            "cost_ratio": cost_ratio, "counting": TREE_COUNTING, "tuned_floors": tuned, "tuned_at_grid_edge": edges,
            "policies": test, "dev_policies": dev, "gains": gains, "left_out": left_out or {}}
