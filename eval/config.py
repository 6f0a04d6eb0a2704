"""The `specheads eval` configuration (YAML and/or flags)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from jsonargparse.typing import ClosedUnitInterval, NonNegativeInt, OpenUnitInterval, PositiveInt

from specheads.artifacts.report_file import REPORT_FILE
from specheads.plumbing.errors import UsageError, refuse_above

FIXED_POLICIES = ("constant_k", "svip", "confidence", "adaedl", "vllm_online", "vllm_current", "vllm_margin", "vllm_history",
                  "pmin", "transformers", "transformers_heuristic", "sglang_adaptive", "sv_companion", "head", "sprinter", "oracle",
                  "dspark_confidence", "dspark_confidence_ts")
"""The policies --fixed-thresholds may name: the sweep's, in its order."""
COST_RULES = ("head_cost", "head_cost_online")
"""The head's stop rule read from the costs, decoded at the stated c where the head allows it: on the head as trained,
and on the head calibrated while serving (`specheads.decoding.calibration`)."""
FIXED_TREES = ("tree_head", "tree_confidence")
"""The trees --fixed-thresholds may give a floor (one for every N of --tree-budgets)."""
WHOLE, NON_NEGATIVE, UNIT = "a whole number >= 1", "a finite number >= 0", "a number in [0, 1]"
FIXED_RANGES = {"constant_k": WHOLE, "oracle": WHOLE, "transformers_heuristic": WHOLE, "sglang_adaptive": WHOLE,
                "svip": NON_NEGATIVE,
                **{policy: UNIT for policy in ("confidence", "adaedl", "vllm_online", "vllm_current", "vllm_margin", "vllm_history", "pmin",
                                               "transformers", "sv_companion", "head", "sprinter", "dspark_confidence",
                                               "dspark_confidence_ts",
                                               *FIXED_TREES)}}
"""The values each policy's threshold may take: a draft length (K, K_max, the heuristic's and SGLang's first K), SVIP's bound on
sqrt(H(q)), or a probability (q(ŷ), AdaEDL's λ, 1 − Π â, a verifier's â, p_min)."""
SERVING_BATCH_POLICIES = ("budget", "smartspec", "goodput", "dcut", "vllm_adaptive", "vllm_current_adaptive",
                          "vllm_margin_adaptive", "vllm_history_adaptive", "goodput_online", "dspark_adaptive",
                          "dspark_adaptive_ts")
"""The batch rules --serving-batch-policies may name (`specheads.decoding.rules.BATCH_POLICIES`, named here so that
parsing the flags imports no torch)."""
FREE_DRAFT_UNUSED = ("decode_prompts", "decode_prompts_column", "unseen_prompts_only", "test_samples", "cost_ratio",
                     "allow_other_data", "head_thresholds", "sprinter_thresholds", "stop_shares", "decode_batch_size",
                     "serving_batch_sizes", "serving_costs", "budget_head", "sv_companion_skip_layers", "reuse_runs",
                     "tuned_from", "fixed_thresholds", "prompt_cache_mb", "eagle3", "dspark", "tree_budgets", "tree_floors")
"""The options of draft models' decoding runs, which a free draft's eval (`eval.lookup`) does not run."""
MEASURED = "measured"
"""--serving-costs' name for the cost curves measured on the decoding device."""
BOUNDS = {"test_samples": (1_000, "each sample decodes every test prompt once more; 2 fill B = 256 from 160 prompts"),
          "bootstrap": (100_000, "resamples of the prompts for each interval; 1,000 give stable 95 % bounds"),
          "max_draft": (256, "candidates a round may draft"),
          "constant_ks": (256, "candidates a constant-K round drafts"),
          "decode_batch_size": (4_096, "prompts decoded together"),
          "serving_batch_sizes": (65_536, "requests served together"),
          "tree_budgets": (1_024, "nodes of one tree, each a row of the tree's attention mask")}
"""Upper bounds on the counts that allocate (or decode) in proportion, with what each counts."""
GRID_FIELDS = {"constant_k": "constant_ks", "svip": "stop_shares", "confidence": "stop_shares", "adaedl": "stop_shares",
               "head": "head_thresholds", "vllm_online": "head_thresholds", "sv_companion": "head_thresholds",
               "vllm_current": "head_thresholds", "vllm_margin": "head_thresholds", "vllm_history": "head_thresholds",
               "pmin": "stop_shares", "dspark_confidence": "head_thresholds", "dspark_confidence_ts": "head_thresholds",
               "sprinter": "sprinter_thresholds", "tree_head": "tree_floors",
               "tree_confidence": "tree_floors"}  # the field that sets each policy's grid


@dataclass
class EvalConfig:
    """What `specheads eval` evaluates and how.

    Args:
        head: a `.ckpt` (or run folder) from `specheads train`, or a head folder / Hub repo id from `specheads export`.
        data: the labelled dataset (`specheads gen --out`); its held-out prompts give the offline tokens.
        out: the report folder (metrics.json, PNG plots, report.md, report.html); while decoding, finished runs are
            journalled to `runs.partial.jsonl` there, and the same command resumes from it (eval.journal).
        decode_prompts: JSONL of prompts to decode; default: the data's held-out prompts. Prompts that leave no room
            in the models' context for max_new_tokens are skipped, and said so (as gen's `long_prompts: skip`).
        decode_prompts_column: the field of each --decode-prompts record that holds its prompt; default: the first of
            messages, prompt, instruction, question, text that it has.
        unseen_prompts_only: decode only prompts the evaluated data holds none of (not even its held-out rows), so
            that heads trained on different splits of one dataset decode the same prompts (and one eval can take the
            other's head-free runs with --reuse-runs).
        num_decode_prompts: how many held-out prompts to decode (half tune thresholds, half are reported).
        test_samples: how many times each test prompt is decoded, each time with its own seed (sample s ≥ 1 as
            `<id>#sample<s>`, numbered after every prompt, so sample 0 decodes as without it): a serving queue long
            enough to fill B = 256 from 160 prompts (at most 1 000). The paired intervals resample prompts with all
            their samples.
        max_new_tokens: tokens generated per decoding run.
        max_draft: cap on a round's candidates (K_max) for the adaptive policies and the oracle.
        cost_ratio: t_draft/t_target of the deployment the modelled speedup is for (0.2 ≈ 7B/70B); a head's forwards
            are charged beside it at the head's weights over the draft's (the report states both).
        bootstrap: resamples of the prompts for the confidence intervals.
        seed: seed of the Bernoulli draws, the bootstrap and the decoding runs.
        allow_other_data: evaluate data made with the head's models and sampling but other prompts or seeds.
        constant_ks: the constant-K baselines' draft lengths (default 1, 2, 3, 4, 6, 8 up to max_draft, and max_draft).
        head_thresholds: the stop head's thresholds to sweep (default 0.3, 0.5, 0.65, 0.8, 0.9).
        sprinter_thresholds: the SPRINTER verifier's thresholds to sweep (default 0.3, 0.5, 0.7, 0.85).
        stop_shares: SVIP's, confidence's, AdaEDL's (starting λ) and llama.cpp's p_min thresholds are the quantiles at
            which each signal stops after these shares of drafted tokens (default 0.1, 0.25, 0.45, 0.65).
        sprinter_max_tv: a verifier's tuned threshold keeps SPRINTER's total-variation distance from the target per
            generated token (estimated on the held-out tokens) at or below this.
        device: where the decoding runs: `auto` (the first GPU when there is one), `cpu`, `cuda`, `cuda:1`.
            Offline metrics read stored features on the CPU.
        progress: show progress bars.
        decode_batch_size: prompts decoded together per setting by the round engine (`specheads.decoding`; every
            row keeps its own seed, so the runs equal those decoded one at a time up to float rounding).
        serving_batch_sizes: also judge each policy at its tuned threshold, the verify budget and SmartSpec's K when
            B requests are served together (`eval.serving`): modelled throughput per B with each model's cost curve,
            and with the draft at cost_ratio × the target; the batch policies are decoded live at every B. Each B
            given once, none above the test requests decoded (a batch the queue never fills is refused).
        serving_costs: the cost views of the serving table, one or a list: a cost table of forward time against
            tokens in the forward, `{draft: {tokens: [...], seconds: [...]}, target: {...}}` (`specheads profile
            --out FILE` measures one on the device it runs on), the name of a roofline preset (`specheads profile
            --help` lists them; modelled at each batch size, and marked so), or `measured` (the curves measured here on
            the decoding device); default: measured. Measured and given curves are also priced with the draft at
            cost_ratio × the target.
        budget_head: an expected-acceptance head (`.ckpt` or exported folder, trained with
            configs/train/expected-acceptance.yaml on data from the same pair) for the verify budget in the serving
            table; not needed when the evaluated head is one.
        budget_floor: the verify budget stops a row's drafting once its predicted survival Π α̂ falls below this.
        sv_companion_skip_layers: SV's companion predictor (eval.companion) with the target minus these layers as
            the companion (on the embedded pair 22-23: the draft's size, another pair skipped): scored offline and,
            for a stop head, decoded as the `sv_companion` stop rule on the head's thresholds (its companion forwards
            counted as draft forwards); off unless given.
        reuse_runs: an earlier report folder whose constant-K, SVIP, confidence and p_min runs are taken instead of
            decoded again, where its runs.json was decoded with the same models, sampling, max_new_tokens,
            max_draft, seed, device type and prompt at the same position (checked); to compare heads cheaply.
        tuned_from: an earlier report of this head whose tuned thresholds are decoded, one per policy, with every
            prompt here a test prompt (none may be one of its dev prompts; checked); to confirm a tuning on
            fresh prompts.
        fixed_thresholds: `{policy: threshold}` (K for constant_k, K_max for the oracle) tuned elsewhere: each
            policy is decoded at its threshold alone and every prompt here is a test prompt, nothing is tuned (the
            demo takes the values docs/results.md tuned on dev prompts, so that all its prompts report). Not empty;
            not head_cost, which decodes at cost_ratio.
        serving_batch_policies: the batch policies decoded live in the serving table (`budget`, `smartspec`, and
            the goodput planner fed by the expected-acceptance head, D-Cut's top-1 product or vLLM's estimate:
            `goodput`, `dcut`, `vllm_adaptive`; on request, the same planner fed vLLM's merged estimator, its margin
            revision, each request's history or the expected-acceptance head calibrated while serving:
            `vllm_current_adaptive`, `vllm_margin_adaptive`, `vllm_history_adaptive`, `goodput_online`; with a DSpark
            drafter's confidence head, `dspark_adaptive` and, through the temperatures eval fits, `dspark_adaptive_ts`,
            which --dspark adds).
        prompt_cache_mb: keep the decode prompts' keys and values (on the decoding device) up to this many MiB, so
            that each setting after the first starts without prefill forwards (`specheads.decoding.prompt_cache`);
            0 turns it off; default 2048, and off with --eagle3 or --dspark (their drafts run without one). Counted
            forwards are the same either way.
        eagle3: an EAGLE-3 drafter folder (speculators' format, e.g. `specheads train drafter`'s DIR/drafter) that
            drafts every decoding run instead of the data's draft, reading the target's streams (the eagle3 extra):
            the free rules, constant K, the oracle, the confidence-valued trees and the serving table decode with it;
            the head's rules are left out (the head read the data's draft's state, not the drafter's) unless this
            drafter labelled the data (`specheads gen --drafter.kind`, the same files; required to decode such data,
            which names no other draft). Not with SV's companion, a prompt cache or a verifier (SPRINTER earns no
            bonus token, which its first round needs).
        dspark: a DSpark drafter folder (speculators' format), as --eagle3, drafting a block per forward (each round
            counted and priced as one forward over its block); with its confidence head, the sweep adds
            `dspark_confidence` (llama.cpp's p_min on it, at --head-thresholds) and the serving table
            `dspark_adaptive` (the goodput planner fed it), each also through per-position temperatures fitted on
            the head's calibration prompts (`dspark_confidence_ts`, `dspark_adaptive_ts`), beside the head's stop
            rule (a paired interval) and its verify budget where the head was trained on this drafter's data.
        tree_budgets: also decode tree drafts (`specheads.decoding.tree`, a batch's trees verified together) with at
            most N nodes per target forward, for each N given: the head-valued tree (an on-time or expected-acceptance
            head) and the confidence-valued tree (EAGLE-2's values), each at the floor tuned on dev prompts like the other
            thresholds (or given by --tuned-from / --fixed-thresholds), and both grown by the costs at --cost-ratio
            (floor 0, tuned nowhere); reported against the head's stop rule and constant K, paired over test
            prompts. Off unless given (trees decode one prompt at a time: slower than the chains).
        tree_floors: the floors the tuned trees sweep on dev prompts (default 0.05, 0.1, 0.2, 0.3, 0.45): a child slot
            is filled while its estimated chance of being reached is at least the floor.
        draft_kind: `model` (a draft model's head, the default) or a free draft's, `lookup` or `suffix`: then --head is
            a token head (`specheads train lookup fit`) and --data its held-out lookup labels (`specheads gen
            --drafter.kind lookup`; the head's validation split where they are its training data), judged beside
            vLLM's table and the proposal's scores offline and, for prompt lookup at T = 0, by the counted replay of
            constant K (--constant-ks), vLLM's table and the head's planner (`eval.lookup`; --max-draft caps the
            adaptive rules, --num-decode-prompts 0 skips the replay).
        fit_data: with a free draft, the lookup labels vLLM's table is counted on; default: the head's training data
            (its training split).
    """

    head: str
    data: str
    out: str = "runs/eval"
    decode_prompts: str | None = None
    decode_prompts_column: str | None = None
    unseen_prompts_only: bool = False
    num_decode_prompts: NonNegativeInt = 16
    test_samples: PositiveInt = 1
    max_new_tokens: PositiveInt = 48
    max_draft: PositiveInt = 8
    cost_ratio: OpenUnitInterval = 0.2
    bootstrap: NonNegativeInt = 200
    seed: int = 0
    allow_other_data: bool = False
    constant_ks: list[PositiveInt] | None = None
    head_thresholds: list[ClosedUnitInterval] | None = None
    sprinter_thresholds: list[ClosedUnitInterval] | None = None
    stop_shares: list[OpenUnitInterval] | None = None
    sprinter_max_tv: ClosedUnitInterval = 0.05
    device: str = "auto"
    progress: bool = True
    decode_batch_size: PositiveInt = 32
    serving_batch_sizes: list[PositiveInt] | None = None
    serving_costs: str | list[str] | None = None
    budget_head: str | None = None
    budget_floor: ClosedUnitInterval = 0.1
    sv_companion_skip_layers: list[NonNegativeInt] | None = None
    reuse_runs: str | None = None
    tuned_from: str | None = None
    fixed_thresholds: dict[str, float] | None = None
    serving_batch_policies: list[Literal[SERVING_BATCH_POLICIES]] = field(
        default_factory=lambda: ["budget", "smartspec", "goodput", "dcut", "vllm_adaptive"])
    prompt_cache_mb: NonNegativeInt | None = None
    eagle3: str | None = None
    dspark: str | None = None
    tree_budgets: list[PositiveInt] | None = None
    tree_floors: list[ClosedUnitInterval] | None = None
    draft_kind: Literal["model", "lookup", "suffix"] = "model"
    fit_data: str | None = None

    @property
    def drafter(self) -> tuple[str, str] | None:
        """(`eagle3` or `dspark`, the folder) of the feature drafter that drafts the decoding runs; None: the data's
        draft does."""
        return named_drafter(self.eagle3, self.dspark)

    @property
    def prompt_cache_bytes(self) -> int:
        """The prompt cache's size: --prompt-cache-mb, by default 2048 MiB, and none for a feature drafter."""
        default = 0 if self.drafter else 2048
        return (default if self.prompt_cache_mb is None else self.prompt_cache_mb) << 20

    @property
    def tunes_here(self) -> bool:
        """Whether thresholds are tuned on dev prompts here (not taken from --tuned-from or --fixed-thresholds)."""
        return not (self.tuned_from or self.fixed_thresholds)

    def validate(self) -> None:
        """Refuse combinations that cannot work, before anything is loaded (each field's own range is in its type,
        checked when the config is parsed)."""
        if self.draft_kind != "model":
            self.validate_free_draft()
            return
        if self.fit_data:
            raise UsageError("--fit-data is the labels vLLM's table is counted on for a free draft's head; give "
                             "--draft-kind lookup (or suffix), or drop it")
        if self.decode_prompts_column and not self.decode_prompts:
            raise UsageError("--decode-prompts-column names the prompt field of --decode-prompts; give --decode-prompts "
                             "too, or drop it (the data's own prompts are read as gen read them)")
        if self.num_decode_prompts == 1:
            raise UsageError("num_decode_prompts must be 0 (no decoding runs) or at least 2 (a dev and a test prompt), "
                             "got 1")
        self.check_bounds()
        self.validate_drafter()
        self.validate_serving()
        if self.reuse_runs:
            require_report_files("--reuse-runs", self.reuse_runs, ("runs.json",))
        if self.tree_floors is not None and not self.tree_budgets:
            raise UsageError("--tree-floors sets the tuned trees' grid, but no tree is decoded; give --tree-budgets "
                             "(e.g. [8]) too, or drop --tree-floors")
        if self.tree_budgets is not None and not self.tree_budgets:
            raise UsageError("--tree-budgets is empty; give node budgets such as [8], or drop it to decode no tree")
        if self.tree_budgets and self.num_decode_prompts < 1:
            raise UsageError("--tree-budgets decodes trees on the decode prompts; give --num-decode-prompts of at "
                             "least 2, or drop --tree-budgets")
        if self.tuned_from and self.fixed_thresholds is not None:
            raise UsageError("--tuned-from and --fixed-thresholds both say which thresholds to decode; give one")
        if self.tuned_from or self.fixed_thresholds is not None:
            self.validate_given_thresholds()

    def validate_free_draft(self) -> None:
        """A free draft's eval (`eval.lookup`) reads its labels' own greedy responses: refuse the options of draft
        models' decoding runs, which it does not run."""
        defaults = EvalConfig(head=self.head, data=self.data)
        unused = [flag(name) for name in FREE_DRAFT_UNUSED if getattr(self, name) != getattr(defaults, name)]
        if unused:
            raise UsageError(f"--draft-kind {self.draft_kind} replays its labels' greedy responses and does not use "
                             f"{', '.join(unused)}; drop {'it' if len(unused) == 1 else 'them'}")
        self.check_bounds()

    def validate_drafter(self) -> None:
        """--eagle3 / --dspark: one drafter, a folder of one, and nothing it cannot decode with yet; the DSpark
        confidence rules only with a DSpark drafter (whether it has its confidence head is checked once it loads)."""
        named = [name for name in ("dspark_confidence", "dspark_adaptive", "dspark_confidence_ts", "dspark_adaptive_ts")
                 if name in (*(self.fixed_thresholds or {}), *self.serving_batch_policies)]
        if named and not self.dspark:
            raise UsageError(f"{' and '.join(named)} read{'s' if len(named) == 1 else ''} a DSpark drafter's confidence "
                             "head; give --dspark DIR, or drop them")
        if not self.drafter:
            return
        option = flag(self.drafter[0])
        for given, what in ((self.sv_companion_skip_layers, "--sv-companion-skip-layers (SV's companion)"),
                            (self.prompt_cache_mb, "--prompt-cache-mb (a prompt cache)")):
            if given:
                raise UsageError(f"{option} drafts without {what} for now; drop it, or drop {option}")

    def check_bounds(self) -> None:
        """Refuse a count beyond its bound in BOUNDS, naming what it counts."""
        for name, (bound, what) in BOUNDS.items():
            refuse_above(flag(name), getattr(self, name), bound, what)

    @property
    def most_test_requests(self) -> int:
        """The most test requests the decode prompts can give: every test prompt (half of them when tuning here) with
        its samples."""
        test_prompts = self.num_decode_prompts // 2 if self.tunes_here else self.num_decode_prompts
        return test_prompts * self.test_samples

    def validate_serving(self) -> None:
        """The serving table's options: batch sizes given once each, none larger than the test requests can fill, and
        every cost view named once; its other options only with it. The tables are read once, after these checks and
        before the head or any model loads (`eval.run.serving_tables`)."""
        sizes = self.serving_batch_sizes
        if sizes is None:
            given = [option for option, value in (("--serving-costs", self.serving_costs),
                                                  ("--budget-head", self.budget_head)) if value is not None]
            if given:
                raise UsageError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for the serving table, but no "
                                 "batch size is served; give --serving-batch-sizes (e.g. [1, 8]) too, or drop "
                                 f"{'it' if len(given) == 1 else 'them'}")
            return
        if not sizes:
            raise UsageError("--serving-batch-sizes is empty; give batch sizes such as [1, 8], or drop it to serve none")
        if len(set(sizes)) < len(sizes):
            raise UsageError(f"--serving-batch-sizes {sizes} gives a batch size twice; give each once")
        if self.num_decode_prompts < 1:
            raise UsageError("--serving-batch-sizes serves the decoding runs; give --num-decode-prompts of at least 2, "
                             "or drop --serving-batch-sizes")
        if max(sizes) > self.most_test_requests:
            raise UsageError(f"--serving-batch-sizes {max(sizes)} is more than the at most {self.most_test_requests} "
                             "test requests this eval decodes, so that batch would never be full; give batch sizes up "
                             "to that, or raise --test-samples or --num-decode-prompts")
        sources = self.serving_cost_sources
        if not sources:
            raise UsageError("--serving-costs is empty; give `measured`, a cost table or a roofline preset (or a list "
                             "of them), or drop it for the curves measured here")
        if len(set(sources)) < len(sources):
            raise UsageError(f"--serving-costs names a view twice ({', '.join(sources)}); give each table or preset once")

    @property
    def serving_cost_sources(self) -> list[str]:
        """The serving table's cost views as given (`measured` when none is)."""
        if self.serving_costs is None:
            return [MEASURED]
        return [self.serving_costs] if isinstance(self.serving_costs, str) else list(self.serving_costs)

    def validate_given_thresholds(self) -> None:
        """`tuned_from` names a report that decoded, or `fixed_thresholds` names known policies; no grid is given
        beside either."""
        option = "--tuned-from" if self.tuned_from else "--fixed-thresholds"
        if self.tuned_from:
            require_report_files("--tuned-from", self.tuned_from, (REPORT_FILE, "runs.json"))
        else:
            if not self.fixed_thresholds:
                raise UsageError("--fixed-thresholds is empty, so nothing would be decoded at a given threshold; give "
                                 "{policy: threshold} (e.g. {head: 0.6, constant_k: 3}), or drop it to tune on dev prompts")
            for rule in COST_RULES:
                if rule in self.fixed_thresholds:
                    raise UsageError(f"--fixed-thresholds gives {rule}, but the head's cost rule has no threshold: it "
                                     "decodes at c = --cost-ratio, tuned nowhere; drop it (and set --cost-ratio)")
            unknown = sorted(set(self.fixed_thresholds) - set(FIXED_POLICIES) - set(FIXED_TREES))
            if unknown:
                raise UsageError(f"--fixed-thresholds names unknown policies {', '.join(unknown)}; use "
                                 f"{', '.join((*FIXED_POLICIES, *FIXED_TREES))}")
            trees = sorted(set(self.fixed_thresholds) & set(FIXED_TREES))
            if trees and not self.tree_budgets:
                raise UsageError(f"--fixed-thresholds gives the floor of {', '.join(trees)}, but no tree is decoded; "
                                 "give --tree-budgets (e.g. [8]) too, or drop them")
            for policy, value in self.fixed_thresholds.items():
                if not in_range(value, FIXED_RANGES[policy]):
                    raise UsageError(f"--fixed-thresholds gives {policy} {value!r}, outside its range: {policy}'s "
                                     f"threshold is {FIXED_RANGES[policy]}; give one in that range")
        grids = [name for name in sorted(set(GRID_FIELDS.values())) if getattr(self, name) is not None]
        if grids:
            raise UsageError(f"{option} decodes only the thresholds it gives; drop {', '.join(flag(name) for name in grids)}")
        if self.num_decode_prompts < 1:
            raise UsageError(f"{option} needs prompts to decode: give --num-decode-prompts of at least 2")

    def as_dict(self) -> dict:
        """Plain dict (for metrics.json)."""
        return asdict(self)


def named_drafter(eagle3: str | None, dspark: str | None) -> tuple[str, str] | None:
    """(`eagle3` or `dspark`, the folder) of the drafter --eagle3 or --dspark names (None: neither), refused in one
    line when both are given or the folder holds no drafter's config.json."""
    if eagle3 and dspark:
        raise UsageError("--eagle3 and --dspark each name the draft; give one of them")
    kind = "eagle3" if eagle3 else "dspark" if dspark else None
    if kind is None:
        return None
    folder = eagle3 or dspark
    if not Path(folder, "config.json").is_file():
        raise UsageError(f"--{kind} {folder}: give the folder of a drafter (its config.json and model.safetensors)")
    return kind, folder


def in_range(value: float, kind: str) -> bool:
    """Whether `value` is a threshold of `kind` (WHOLE, NON_NEGATIVE or UNIT); NaN never is."""
    if kind == WHOLE:
        return math.isfinite(value) and value >= 1 and value == int(value)
    if kind == NON_NEGATIVE:
        return 0 <= value < math.inf
    return 0 <= value <= 1


def flag(field: str) -> str:
    """The command-line flag of an EvalConfig field."""
    return "--" + field.replace("_", "-")


def require_report_files(flag: str, folder: str, names: tuple[str, ...]) -> None:
    """Refuse a `flag` folder that lacks any of the files `names` of a `specheads eval` report that decoded."""
    missing = [name for name in names if not (Path(folder) / name).is_file()]
    if missing:
        raise UsageError(f"{flag} {folder} holds no {' or '.join(missing)}; give the folder of an earlier "
                         "`specheads eval` report that decoded")
