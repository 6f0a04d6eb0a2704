"""The `specheads gen` configuration: one dataclass tree, read from YAML and overridden by flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from jsonargparse.typing import ClosedUnitInterval, NonNegativeFloat, OpenUnitInterval, PositiveInt

from specheads.dataset.storage import FeaturesAt, FeaturesDtype
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.models import ModelSpec, derived_draft
from specheads.pair.placement import check_spec_placement
from specheads.plumbing.errors import UsageError, refuse_above

GEN_BOUNDS = {"samples_per_prompt": (10_000, "each sample is a row of its own, planned in memory before labelling"),
              "batch_size": (65_536, "rows labelled together in one forward pass"),
              "rows_per_shard": (1_000_000, "rows one Arrow shard holds in memory before it is written"),
              "label_chunk_tokens": (1_000_000, "positions whose vocabulary-sized p and q are computed at once"),
              "threads": (1_024, "torch threads each rank labels with")}
"""Upper bounds on gen's counts that allocate in proportion, with what each counts."""


@dataclass
class SamplingConfig:
    """The decoding's sampling transform and response length (T = 0 means greedy)."""

    temperature: float = 1.0  # the three transform values are checked by SamplingTransform itself
    """the softmax temperature of p and q; 0 is greedy (shorthand --temperature)."""
    top_k: int = 0
    """keep only the k most likely tokens; 0 keeps all (shorthand --top-k)."""
    top_p: float = 1.0
    """keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all (shorthand --top-p)."""
    max_new_tokens: PositiveInt = 128
    """response tokens per row, generated or kept from an imported response (shorthand --max-new-tokens)."""

    def transform(self) -> SamplingTransform:
        """The transform p and q are labelled under (validates the values)."""
        return SamplingTransform(self.temperature, self.top_k, self.top_p)


@dataclass
class MixingConfig:
    """Token mixing: each position keeps the target token with probability `target_ratio`.

    `schedule`, when given, replaces the single ratio by a per-row ratio taken in turn from the list
    (for SPRINTER's prefix kinds, e.g. [0.0, 1.0, 0.15]: draft-only, target-only and mixed rows).
    """

    target_ratio: ClosedUnitInterval = 0.15
    """the probability r that a position keeps the target's token."""
    schedule: list[ClosedUnitInterval] | None = None
    """per-row ratios used in turn instead of target_ratio, e.g. [0.0, 1.0, 0.15]."""

    def ratios(self) -> list[float]:
        """The per-row ratios, cycled over rows."""
        return [float(r) for r in self.schedule] if self.schedule else [float(self.target_ratio)]


@dataclass
class GenerationOptions:
    """How the responses are generated. The built-in engine's settings leave each row's response to its seed
    (data_gen.engines); `vllm_args` only configures vLLM.

    Args:
        cache: the built-in engine's KV cache: `dynamic` (grows per step) or `static` (preallocated per batch, its
            length rounded up to a bucket of 64 tokens; what compiled decoding needs).
        compile: compile the decoding step with torch.compile (needs `cache: static`); on a GPU transformers then
            replays it as a CUDA graph. The first batch of each new shape pays the compilation.
        batch_size: rows per `generate` call: unset = the labelling `batch_size`; a number; or `auto` = as many
            as fit in `memory_fraction` of the free GPU memory (KV cache plus per-row workspace), at most a shard's
            rows (`rows_per_shard`). On a CPU `auto` falls back to the labelling `batch_size`. Where gen samples and
            labels in one pass (a CPU, a derived draft, the dynamic cache uncompiled: data_gen.onepass) a number caps
            the rows of a pass, which are otherwise the shard's.
        memory_fraction: the share of the free GPU memory `batch_size: auto` plans for.
        vllm_args: keyword arguments for `vllm.LLM` under `responses_engine: vllm` (e.g. tensor_parallel_size,
            gpu_memory_utilization, max_num_seqs, dtype); the model, tokenizer, revision and dtype are `target`'s
            unless given here.
    """

    cache: Literal["dynamic", "static"] = "dynamic"
    compile: bool = False
    batch_size: PositiveInt | Literal["auto"] | None = None
    memory_fraction: OpenUnitInterval = 0.9
    vllm_args: dict[str, Any] = field(default_factory=dict)


FREE_DRAFTS = ("lookup", "suffix")
"""The drafter kinds that load no model: their proposals are read from the context (`data_gen.lookup_labels`)."""


@dataclass
class DrafterOption:
    """A feature drafter as the draft (`data_gen.drafter_labels`): an EAGLE-3 or DSpark drafter in speculators' format,
    made for the target (`specheads train drafter`, or speculators). It replaces `draft`. Or a free draft
    (`data_gen.lookup_labels`): `lookup` (prompt lookup / n-gram) or `suffix` (a suffix tree), which loads no model.

    Args:
        kind: `eagle3` or `dspark` (a folder of the other kind, or made for another target, is refused); `lookup` or
            `suffix`.
        path: the drafter's folder (config.json + model.safetensors); none for a free draft.
        depth: K_max, the deepest position of a round its chains draft (the mix's runs of drafted positions are
            rounds); default: the drafter's own (EAGLE-3: the speculative tokens its config proposes; DSpark: its
            block's candidates, the most it may be). A free draft's most tokens per proposal (default 8).
        max_ngram, min_ngram: the n-grams prompt lookup matches, longest first (`lookup` only).
        max_spec_factor, min_token_prob: how far SuffixDecoding reads its tree (at most `max_spec_factor` · the match
            length tokens, none whose estimated probability is below `min_token_prob`; `suffix` only; default its
            own, 1 and 0.1): label the drafts a rule will cut (`suffix_plan` reads factor 4, no floor).
        labels: a free draft's labels: `all` proposed tokens (one packed target forward reads the proposals), or only
            those a decode can reach, up to the first that departs from the response (no forward beyond the
            response's own; at T = 0 exactly the tokens a decode reaches).
    """

    kind: Literal["eagle3", "dspark", "lookup", "suffix"]
    path: str | None = None
    depth: PositiveInt | None = None
    max_ngram: PositiveInt = 3
    min_ngram: PositiveInt = 1
    max_spec_factor: NonNegativeFloat | None = None
    min_token_prob: ClosedUnitInterval | None = None
    labels: Literal["all", "reached"] = "all"

    def suffix_settings(self) -> dict[str, float]:
        """The suffix tree's reading settings given on the command line (none: SuffixDecoding's defaults)."""
        given = {"max_spec_factor": self.max_spec_factor, "min_token_prob": self.min_token_prob}
        return {name: value for name, value in given.items() if value is not None}


@dataclass
class GenConfig:
    """Everything `specheads gen` needs. Flags override the YAML (`--num-prompts 8`, `--sampling.temperature 0`)."""

    target: ModelSpec = field(default_factory=lambda: ModelSpec(path="embedded:smollm2"))
    """The target model, whose acceptance of the draft is labelled."""
    draft: ModelSpec = field(default_factory=lambda: ModelSpec(skip_layers=[20, 21]))
    """The draft model; by default the target minus layers 20-21 (self-speculative)."""
    drafter: DrafterOption | None = None
    """A feature drafter as the draft instead (`--drafter.kind eagle3|dspark --drafter.path DIR`): its states and
    labels at each position's depth in its round (docs/data.md "Feature drafters")."""
    prompts: str = "builtin"
    """the prompt source: `builtin` (200 mixed prompts), a JSONL file, or a Hugging Face dataset name or folder."""
    prompts_split: str = "train"
    """the split to read when --prompts names a Hugging Face dataset."""
    prompts_column: str | None = None
    """the field holding each prompt; default: the first of messages, prompt, instruction, question, text."""
    num_prompts: PositiveInt | None = None
    """label only the first N prompts; default: all."""
    samples_per_prompt: PositiveInt = 1
    """responses sampled per prompt, each a row with its own seed."""
    responses: str | None = None
    """a JSONL of finished responses to label instead of generating them (`{"id": ..., "response": "text"}` or
    `"response_ids"`, e.g. from vLLM or SGLang)."""
    responses_engine: Literal["transformers", "vllm"] = "transformers"
    """what generates the responses: `transformers`, or `vllm` (CUDA only; data_gen.vllm_engine)."""
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    """How the responses are generated."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """The sampling transform p and q are labelled under, and the response length."""
    mixing: MixingConfig = field(default_factory=MixingConfig)
    """Token mixing: which positions keep the target's token instead of the draft's."""
    store_features: bool = True
    """store the draft's hidden states for training; false stores none, and training then runs the draft (much slower)."""
    features_at: FeaturesAt = "all"
    """which draft states to store: `all`, `drafted`, `drafted_candidate` or `drafted_context` (data_gen.storage,
    docs/data.md "Storage at scale")."""
    features_dtype: FeaturesDtype = "float16"
    """the stored states' dtype: float16, or bfloat16 where they exceed float16's 65 504."""
    state_layer: PositiveInt | None = None
    """store the draft's residual stream after its first L decoder layers; default: its last layer after the final norm."""
    target_states: bool = False
    """also store the target's last-layer states (after the final norm) on the same prompt + mixed tokens, column
    `target_features`: a head may read the state the target computed at the last position it verified."""
    sibling_labels: bool = False
    """also label a tree's second child at each position: `sibling_ids` drawn from q without the drafted candidate,
    its acceptance `sibling_accept` = min(1, p₂/q₂) once the drafted candidate was rejected (p₂ = norm(max(0, p −
    q)), recursive rejection sampling), `sibling_beta` = Σ min(p₂, q₂) and its draft signal `sibling_logq` = log q(x₂)
    (docs/data.md)."""
    long_prompts: Literal["skip", "fail"] = "skip"
    """a prompt too long for the context: `skip` it (counted, its id kept in the manifest) or `fail`."""
    max_prompt_tokens: PositiveInt | None = None
    """prompts longer than this count as too long; default: the context minus max_new_tokens."""
    batch_size: PositiveInt = 8
    """rows labelled together in one forward pass."""
    rows_per_shard: PositiveInt = 32
    """rows per Arrow shard, a multiple of batch_size; a killed run redoes only its unfinished shards."""
    label_chunk_tokens: PositiveInt = 256
    """positions whose vocabulary-sized p and q are computed at once (bounds peak memory)."""
    out: str = "runs/gen"
    """the dataset folder (shards/, manifest.json, README.md card); the same command resumes it."""
    overwrite: bool = False
    """replace an `out` folder that holds other data (another fingerprint, or files of its own)."""
    seed: int = 0
    """seed of sampling and mixing; each row's draws follow from it and the row alone."""
    devices: PositiveInt = 1
    """data-parallel ranks (processes) per node."""
    threads: PositiveInt = 1
    """torch threads each rank labels with. A CPU's float sums depend on it (a draw near a boundary of the
    distribution then flips), so it is set, not taken from the machine or OMP_NUM_THREADS, and the data fingerprint
    records it: the same config gives the same rows on 1 or N ranks. For speed on idle cores add ranks (--devices);
    more threads give other rows (another fingerprint)."""
    gpus_per_rank: PositiveInt = 1
    """GPUs each rank spreads its models over (target.device_map; data_gen.placement)."""
    accelerator: str = "auto"
    """Lightning's accelerator: auto, cpu, gpu (cuda) or mps."""
    num_nodes: PositiveInt = 1
    """machines taking part (each started by torchrun or a cluster launcher)."""
    progress: bool = True
    """show a progress bar."""

    def validate(self) -> None:
        """Refuse combinations that cannot work, before anything is loaded or written (each field's own range is in
        its type, checked when the config is parsed), and counts beyond their bounds (`GEN_BOUNDS`)."""
        for name, (bound, what) in GEN_BOUNDS.items():
            refuse_above(f"--{name}", getattr(self, name), bound, what)
        if self.rows_per_shard % self.batch_size:
            raise UsageError(f"rows_per_shard ({self.rows_per_shard}) must be a multiple of batch_size ({self.batch_size})")
        if self.sampling.temperature == 0 and self.samples_per_prompt > 1 and self.responses is None:
            raise UsageError(f"at temperature 0 every sample of a prompt is the same greedy response; set "
                             f"samples_per_prompt to 1 (got {self.samples_per_prompt}) or sample with temperature > 0")
        if not self.store_features and (self.features_at != "all" or self.features_dtype != "float16"):
            raise UsageError(f"features_at ({self.features_at}) and features_dtype ({self.features_dtype}) choose how "
                             "stored states are kept, but store_features is false; drop them or set store_features true")
        if self.target_states and (not self.store_features or self.features_at != "all"):
            raise UsageError("target_states stores the target's states beside the draft's at every position; it needs "
                             "store_features true and features_at all (drop target_states, or set those)")
        if self.sibling_labels and self.sampling.temperature == 0:
            raise UsageError("sibling_labels label a second child drawn from q, but at temperature 0 q is one-hot and "
                             "a tree takes the draft's best tokens instead; drop sibling_labels or sample with "
                             "temperature > 0")
        self.check_generation()
        self.check_drafter()
        self.check_placement()
        self.sampling.transform()

    def check_placement(self) -> None:
        """Refuse placements that cannot work, from the config alone (nothing loaded, no GPU needed; the node's GPUs
        are checked when gen starts, data_gen.placement)."""
        if self.gpus_per_rank > 1:
            if self.accelerator == "cpu":
                raise UsageError(f"gpus_per_rank {self.gpus_per_rank} needs GPUs but accelerator is cpu; "
                                 "set accelerator gpu (or auto), or gpus_per_rank 1")
            if self.target.device_map is None and self.draft.device_map is None:
                raise UsageError(f"gpus_per_rank {self.gpus_per_rank} gives each rank GPUs that no model would use; "
                                 "set target.device_map auto to spread the target over them, or gpus_per_rank 1")
        if derived_draft(self.draft) and (self.draft.device_map is not None or self.draft.max_memory is not None):
            raise UsageError("draft.device_map and draft.max_memory do not apply to a draft derived from the target "
                             "(draft.skip_layers): it shares the target's weights where they are; drop them and set "
                             "target.device_map")
        for role, spec in (("target", self.target), ("draft", self.draft)):
            check_spec_placement(role, spec, self.gpus_per_rank)

    def check_drafter(self) -> None:
        """Refuse, with `drafter`, what a feature drafter's data cannot hold (docs/data.md "Feature drafters")."""
        if self.drafter is None:
            return
        if self.drafter.kind in FREE_DRAFTS:
            self.check_free_draft()
            return
        if self.drafter.labels != "all":
            raise UsageError(f"--drafter.labels {self.drafter.labels} applies to free drafts (lookup, suffix); drop it")
        if self.drafter.path is None:
            raise UsageError(f"--drafter.kind {self.drafter.kind} drafts with a trained drafter: give its folder with "
                             "--drafter.path DIR")
        given = [name for name, on in (("--draft", self.draft != GenConfig().draft), ("--state-layer", self.state_layer),
                                       ("--target-states", self.target_states)) if on]
        if given:
            raise UsageError(f"{', '.join(given)} cannot go with --drafter (the drafter is the draft, its state the one "
                             "after its final norm that produced q); drop them")
        if not self.store_features or self.features_at == "drafted_candidate":
            raise UsageError("a feature drafter's data stores the state that produced each q, which only gen can "
                             "compute (no online training) and no state that has read the candidate: set "
                             "store_features true and features_at all, drafted or drafted_context")

    def check_free_draft(self) -> None:
        """Refuse, with a free draft (`--drafter.kind lookup|suffix`), what its labels cannot use."""
        option = self.drafter
        given = [name for name, on in (("--drafter.path", option.path is not None),
                                       ("--draft", self.draft != GenConfig().draft), ("--responses", self.responses),
                                       ("--responses-engine vllm", self.responses_engine == "vllm"),
                                       ("--devices/--num-nodes", self.devices * self.num_nodes > 1)) if on]
        if given:
            raise UsageError(f"{', '.join(given)} cannot go with --drafter.kind {option.kind} (a free draft reads its "
                             "proposals from the context and gen labels it in one process); drop them")
        if option.kind != "suffix" and option.suffix_settings():
            flags = ", ".join(f"--drafter.{name}" for name in option.suffix_settings())
            raise UsageError(f"{flags} read a suffix tree; drop them or use --drafter.kind suffix")
        if option.min_ngram > option.max_ngram:
            raise UsageError(f"--drafter.min_ngram {option.min_ngram} is above --drafter.max_ngram {option.max_ngram}; "
                             "give min_ngram <= max_ngram")

    def check_generation(self) -> None:
        """Refuse generation settings that cannot work together."""
        if self.generation.compile and self.generation.cache != "static":
            raise UsageError("generation.compile needs generation.cache: static (transformers compiles the decoding "
                             "step only over a static KV cache); set --generation.cache static or drop the compile")
        if self.responses_engine == "vllm" and self.responses is not None:
            raise UsageError("--responses imports finished responses and --responses-engine vllm generates them; "
                             "pass one of the two")
        if self.responses_engine == "vllm" and self.devices * self.num_nodes > 1:
            raise UsageError(f"--responses-engine vllm generates in one process ({self.devices * self.num_nodes} asked "
                             "for); set --devices 1 --num-nodes 1 (vLLM spreads the target itself: generation.vllm_args "
                             "tensor_parallel_size), or write the responses with vLLM first and pass them with --responses")

    def as_dict(self) -> dict:
        """Plain dict (for the manifest)."""
        return asdict(self)
