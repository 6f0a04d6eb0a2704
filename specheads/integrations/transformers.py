"""An exported head drives transformers' `generate`, exactly, through its public `custom_generate` hook.

    from specheads.integrations.transformers import speculative_generate
    from specheads.heads import load_head

    head = load_head("user/my-head")                    # or the folder `specheads export` wrote
    out = target.generate(**inputs, custom_generate=speculative_generate, draft=draft, head=head,
                          do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=256)

`generate` prepares the inputs, the logits processors and the stopping criteria from its arguments and the
generation config, then calls `speculative_generate`, which runs the decoding core's round engine
(`specheads.decoding`) with the head's exported decision rule: the draft proposes candidates until
1 − Π â exceeds the rule's threshold, or, for a head exported with the rule read from the costs, until the next
candidate no longer pays for itself at the stated t_draft/t_target (`cost_ratio=` gives yours), or its `max_draft`;
the target checks them in one forward, and the p/q test
keeps the output the target's own distribution (greedy: token for token what `target.generate(do_sample=False)`
gives).

What it honours: temperature, top-k and top-p (the sampling transform the head was trained for; another one is
refused, since the head's labels describe one decoding), max_new_tokens / max_length, the EOS ids, and every
stopping criterion `generate` hands over (a `StopStringCriteria` passed in `stopping_criteria`, MaxTimeCriteria,
your own), checked after each new token so the output ends where the target alone would end it. Batches of
left-padded prompts decode together, as do num_return_sequences samples of a prompt: each row draws with its own
generator, seeded from torch's global RNG, so `torch.manual_seed` makes runs repeatable.

Trees: `tree=TreeRule(...)` (`specheads.decoding.tree`), or a dict of its fields (`tree={"values": "head",
"floor": 0.0, "budget": 8, "cost_ratio": 0.2}`, a `curve` as `{tokens: [...], seconds: [...]}`), drafts a token
tree each round in place of the chain and verifies it in one target forward, exactly (each prompt decoded alone);
`cost_ratio=` gives a tree without one cost-aware growth. A tree valued by draft confidence (`values: confidence`,
EAGLE-2's) needs no head. Neither does a chain drafted by a DSpark drafter (`draft=DSparkModel(drafter, target)`,
`specheads.decoding.dspark`) without `head=`: it drafts its whole block each round, as vLLM serves it.

Prompt lookup: `prompt_lookup_num_tokens=K` (transformers' own argument, `max_matching_ngram_size` too) drafts from
the context instead of a draft model (`specheads.decoding.free_draft`: the last n-gram's earliest earlier occurrence,
as transformers' `PromptLookupCandidateGenerator` finds it) and verifies each proposed token exactly, as a point-mass
draft (accepted with p(x), a rejection resampled from p without x), so `draft=` is not needed; sampling gives the
target's distribution, greedy decoding what `target.generate(do_sample=False)` gives, in batches too (transformers'
own prompt lookup takes one prompt). Without `head=` a round verifies the whole proposal up to K, as transformers does;
with a token-only head (`specheads.lookup.token_head.TokenHead.load(folder)`) the verify length is the one that
maximises the tokens a round emits over what its verify costs (`lookup_plan`). `draft=LookupDraft("suffix")` drafts
SuffixDecoding's suffix trees instead.

What transformers 5.x does not hand a `custom_generate` callable, and how to pass it instead:
- `assistant_model` is dropped: pass the draft as `draft=`.
- `streamer` is dropped (generate puts only the prompt into it, then calls the callable without it): pass the
  streamer as `token_streamer=`; a `streamer=` is refused (it is read off generate's frame, the one place it is).
- `stop_strings` needs the tokenizer, which is dropped too: pass
  `stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, [...])])`.

A draft whose vocabulary has another number of padded rows than the target's (Qwen2.5-0.5B drafting for
Qwen2.5-7B: 151 936 and 152 064 rows) decodes exactly, as transformers' assisted generation accepts it: the round
engine takes q over the target's rows (`specheads.decoding.engine.fit_vocabulary`): the target's extra rows keep
their probability under p (the residual draw can give them), the draft's extra rows are never proposed.

Refused with one line each: a logits processor other than temperature, top-k and top-p (repetition penalty, min
length, suppressed tokens ... change p with the text and are not what the head was trained on), beam search and the
other decoding modes (contrastive search's `penalty_alpha`, DoLa's `dola_layers`, an early-exit assistant ...), inputs other
than the prompt's ids (pixel values, encoder outputs, inputs_embeds), return_dict_in_generate and the output_*
switches, a prefilled cache, a head of a role other than a chain stop or expected-acceptance head (a SPRINTER
verifier: approximate by design; a sibling head, trained on a tree's second children), a loaded head whose
config.json records no sampling, a head whose hidden size or state layer does not fit the draft or that reads the
target's state, and a draft or target that is provably not the one the head was trained for (`check_trained_for`: a
derived draft's skipped layers and the target its tensors are, a Hub draft's repo id and recorded architecture).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve
from specheads.decoding.drafters import generate_draft_refusal
from specheads.decoding.engine import check_decodable_head
from specheads.decoding.features import FeatureDraft
from specheads.decoding.free_draft import LookupDraft
from specheads.decoding.free_rules import EstimatorPlanned
from specheads.decoding.result import DecodeResult
from specheads.decoding.tree import TreeRule, decode_tree
from specheads.heads import AcceptanceHead, load_head
from specheads.heads.loading import COST_RULE, STOP_RULES, DecisionRule, is_number
from specheads.heads.roles import CHAIN_HEADS, check_role
from specheads.lookup.planning import PACKED_CPU_TOKEN_COST
from specheads.model_outputs.sampling import SamplingTransform
from specheads.pair.embedded import EMBEDDED_NAME
from specheads.pair.models import ModelSpec, derived_layers, resolve_source, weights_identity, whole_file_weights_sha256
from specheads.plumbing.errors import UsageError
from specheads.plumbing.hub import is_hub_id

UNSUPPORTED_SWITCHES = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                        "output_hidden_states")
"""Generation-config switches that ask for per-step outputs a speculative round does not produce one token at a time."""
TRANSFORM_FIELDS = ("temperature", "top_k", "top_p")
PROMPT_KWARGS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                           "cache_position"})
"""The model kwargs generate prepares from a text prompt; the round engine rebuilds each from the prompt's ids."""
ARCHITECTURE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "vocab_size")
"""The config fields a model is compared by with the config.json of the Hub snapshot a head's data was made from."""


def sampling_of(processors: LogitsProcessorList, do_sample: bool) -> SamplingTransform:
    """The sampling transform `generate` prepared (temperature, then top-k, then top-p), or greedy; any other
    processor is refused."""
    if not do_sample:
        others = [type(p).__name__ for p in processors]
        if others:
            raise UsageError(f"speculative_generate does not support the logits processors {', '.join(others)}: the head "
                             "was trained on the draft's and target's own distributions; drop those generate options")
        return SamplingTransform(temperature=0.0)
    values: dict[str, Any] = {}
    for processor in processors:
        if isinstance(processor, TemperatureLogitsWarper):
            name, value = "temperature", float(processor.temperature)
        elif isinstance(processor, TopKLogitsWarper):
            name, value = "top_k", int(processor.top_k)
        elif isinstance(processor, TopPLogitsWarper):
            name, value = "top_p", float(processor.top_p)
        else:
            raise UsageError(f"speculative_generate does not support the logits processor {type(processor).__name__}: "
                             "it changes the target's distribution in a way the head was not trained for; use "
                             "temperature, top_k and top_p only")
        if name in values or any(TRANSFORM_FIELDS.index(earlier) > TRANSFORM_FIELDS.index(name) for earlier in values):
            raise UsageError("speculative_generate applies temperature, then top-k, then top-p, once each; a "
                             "logits_processor of yours repeats one or comes out of that order: pass them as "
                             "generate's temperature, top_k and top_p instead")
        values[name] = value
    return SamplingTransform(**values)


def resolve_head(head: Any) -> tuple[AcceptanceHead, DecisionRule]:
    """The head and its decision rule, from `load_head`'s pair, a head folder or Hub id, or a bare head (untuned
    default rule)."""
    if head is None:
        raise UsageError("speculative_generate needs head=: load_head('your/head') or the folder `specheads export` "
                         "wrote")
    if isinstance(head, str):
        head = load_head(head)
    if isinstance(head, AcceptanceHead):
        head = (head, DecisionRule.untuned(type(head).purpose))
    if not (isinstance(head, tuple) and len(head) == 2 and isinstance(head[0], AcceptanceHead)):
        raise UsageError(f"head= must be what load_head returns, a head folder or Hub id; got {type(head).__name__}")
    module, rule = head
    check_role(module, CHAIN_HEADS, "speculative_generate's head=")
    if rule.rule not in STOP_RULES:
        raise UsageError(f"this head's rule is {rule.rule} (a SPRINTER verifier: approximate decoding); "
                         "speculative_generate runs exact speculative decoding with a stop head")
    return module, rule


def check_cost_ratio(cost_ratio: Any) -> None:
    """Refuse a `cost_ratio=` that is not a number in (0, 1) (None: the head's or the tree's own)."""
    if cost_ratio is not None and not (is_number(cost_ratio) and 0.0 < cost_ratio < 1.0):
        raise UsageError(f"cost_ratio= is t_draft/t_target, a number in (0, 1); got {cost_ratio!r}")


def rule_policy(rule: DecisionRule, cost_ratio: float | None) -> Any:
    """The decoding rule of a head's exported rule: its tuned stop threshold, or the rule read from the costs at the
    exported c or at `cost_ratio` (the caller's hardware), which only that rule can take."""
    if rule.rule == COST_RULE:
        return make_policy("head_cost", rule.threshold if cost_ratio is None else cost_ratio, rule.max_draft or 8)
    if cost_ratio is not None:
        raise UsageError(f"this head carries a threshold tuned for t_draft/t_target = {rule.cost_ratio} (its calibration "
                         "did not allow the rule read from the costs); drop cost_ratio=, or tune it again for yours "
                         "with `specheads eval --cost-ratio`")
    return make_policy("head", rule.threshold, rule.max_draft or 8)


def tree_rule(tree: Any, cost_ratio: float | None) -> TreeRule | None:
    """The `tree=` argument as a `TreeRule` (a TreeRule, or a dict of its fields), with `cost_ratio=` as its growth's
    cost ratio when it has none; None without a tree."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        fields = {f.name for f in dataclasses.fields(TreeRule)}
        unknown, missing = sorted(set(tree) - fields), [f for f in ("values", "floor", "budget") if f not in tree]
        if unknown or missing:
            raise UsageError(f"tree= {'has unknown fields ' + ', '.join(unknown) if unknown else 'lacks ' + ', '.join(missing)}"
                             f"; a tree is a TreeRule or a dict of its fields: values, floor, budget (required), "
                             f"{', '.join(sorted(fields - {'values', 'floor', 'budget'}))}")
        curve = tree.get("curve")
        tree = TreeRule(**{**tree, "curve": CostCurve.from_dict(curve) if isinstance(curve, dict) else curve})
    if not isinstance(tree, TreeRule):
        raise UsageError(f"tree= must be a TreeRule (specheads.decoding.tree) or a dict of its fields, got "
                         f"{type(tree).__name__}")
    if cost_ratio is not None and tree.cost_ratio is not None and cost_ratio != tree.cost_ratio:
        raise UsageError(f"cost_ratio={cost_ratio} and the tree's cost_ratio={tree.cost_ratio} differ; give it once")
    return tree if cost_ratio is None else dataclasses.replace(tree, cost_ratio=cost_ratio)


def own_rule(draft: Any) -> Any:
    """The chain rule a draft decodes by when no head is given: a block drafter's whole block a round
    (`FeatureDraft.own_rule`, a DSpark drafter's); None for every other draft, which needs a head."""
    return draft.own_rule() if isinstance(draft, FeatureDraft) else None


def check_draft(draft: Any) -> None:
    """Refuse a call without a draft."""
    if draft is None:
        raise UsageError("speculative_generate needs draft=<the draft model>; transformers does not hand "
                         "assistant_model to a custom_generate callable")


def check_pair(head: AcceptanceHead, draft: Any, transform: SamplingTransform) -> None:
    """Refuse a head that cannot read this draft's states or was trained for another sampling transform."""
    check_draft(draft)
    hidden = getattr(draft.config, "hidden_size", None)
    if hidden != head.hidden_size:
        raise UsageError(f"the head reads draft states of size {head.hidden_size}, this draft's are {hidden}: it was "
                         "trained for another draft; use a head trained for this one")
    layers = getattr(draft.config, "num_hidden_layers", None)
    if head.state_layer is not None and layers is not None and head.state_layer > layers:
        raise UsageError(f"the head reads the draft's layer {head.state_layer}, this draft has {layers} layers: it "
                         "was trained for another draft; use a head trained for this one")
    loaded = getattr(head, "trained_for", None)
    recorded = (loaded or {}).get("sampling")
    if loaded is not None and not recorded:
        raise UsageError("the head's config.json records no sampling (the temperature, top_k and top_p its labels were "
                         "made under), so nothing says this call decodes as it was trained; re-export it with "
                         "`specheads export`, which records it")
    trained = None if recorded is None else SamplingTransform(**{k: recorded[k] for k in TRANSFORM_FIELDS if k in recorded})
    if trained is not None and trained != transform:
        raise UsageError(f"the head was trained for sampling {trained.as_dict()}, this generate call "
                         f"samples with {transform.as_dict()} (generate's defaults included: top_k=50 unless given): its "
                         "predictions describe another decoding; pass the head's temperature, top_k and top_p, or "
                         "train a head for yours")


def loaded_from(model: Any) -> Path | None:
    """The local folder `model` was loaded from (its config's name_or_path), None for a Hub id or a model built in
    memory."""
    name = getattr(getattr(model, "config", None), "name_or_path", None)
    folder = Path(name).expanduser() if isinstance(name, str) and name else None
    return folder.resolve() if folder is not None and folder.is_dir() else None


def recorded_config(spec: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json of the Hub snapshot a head's data was made from (its repo id and commit, as recorded), when
    the local Hugging Face cache holds it; None otherwise (nothing is downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    path, commit = spec.get("path"), recorded.get("revision")
    if not is_hub_id(path) or not isinstance(commit, str) or spec.get("gguf_file"):
        return None
    cached = try_to_load_from_cache(path, "config.json", revision=commit)
    try:
        config = json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def architecture_mismatch(recorded: dict[str, Any], model: Any) -> str | None:
    """The first `ARCHITECTURE_FIELDS` value in which `model`'s config differs from the `recorded` config.json."""
    config = getattr(model, "config", None)
    for name in ARCHITECTURE_FIELDS:
        here = getattr(config, name, None)
        if name in recorded and here is not None and here != recorded[name]:
            return f"its {name} is {here!r}, the head was trained on a model with {recorded[name]!r}"
    return None


def weights_mismatch(recorded: dict[str, Any] | None, model: Any) -> str | None:
    """What provably differs between `model` and the weights a head's config.json records for it
    (`specheads.pair.models.weights_identity`), or None. Provable: another model class; another Hub repo id than the
    recorded one (both Hub ids, the model's its config's `name_or_path`); an architecture (`ARCHITECTURE_FIELDS`)
    other than that of the recorded Hub commit's config.json, where the local cache holds it; or the very folder the
    head's data was made from whose files no longer hash as recorded. Not provable, so let through: a model from
    another folder (the same weights can be laid out in other files), or built in memory."""
    if not recorded:
        return None
    here = type(getattr(model, "_orig_mod", model)).__name__  # a torch.compile'd model is its module
    if recorded.get("class") and recorded["class"] != here:
        return f"it is a {here}, the head was trained on a {recorded['class']}"
    spec = recorded.get("spec") or {}
    path, folder = spec.get("path"), loaded_from(model)
    name = getattr(getattr(model, "config", None), "name_or_path", None)
    if is_hub_id(path) and is_hub_id(name) and name != path:
        return f"it was loaded from {name}, the head was trained on {path}"
    snapshot = recorded_config(spec, recorded)
    differs = architecture_mismatch(snapshot, model) if snapshot else None
    if differs:
        return f"{differs} ({path} at {recorded['revision'][:12]})"
    if not recorded.get("weights_sha256") or folder is None or not isinstance(path, str) or path == EMBEDDED_NAME:
        return None
    if not Path(path).expanduser().exists():
        return None
    named = ModelSpec(path=path, revision=spec.get("revision"), gguf_file=spec.get("gguf_file"))
    source = resolve_source(named)
    if not source.is_local or Path(source.location).resolve() != folder:
        return None
    if (weights_identity(named, model).get("weights_sha256") != recorded["weights_sha256"]
            and whole_file_weights_sha256(named) != recorded["weights_sha256"]):  # a record made before metadata sorting
        return f"the files of {folder} have changed since the head's data was made from them"
    return None


def derived_mismatch(weights: dict[str, Any], draft: Any, target: Any) -> str | None:
    """What provably differs between `draft` and the draft derived from the target a head records (`weights`: its
    `skip_layers`): its tensors are not the target's own, or it skips other layers. Where the layers cannot be told
    apart (`derived_layers`), the layer counts alone."""
    recorded = sorted(weights.get("skip_layers") or [])
    layers = [getattr(model.config, "num_hidden_layers", None) for model in (draft, target)]
    kept = derived_layers(draft, target)
    if kept is None:
        return (f"its weights are not this target's (a draft derived from the target is the target's own tensors "
                f"with layers {recorded} skipped)")
    if kept is False:
        if None not in layers and layers[0] != layers[1] - len(recorded):
            return f"it has {layers[0]} layers, the target minus {len(recorded)} has {layers[1] - len(recorded)}"
        return None
    skipped = [index for index in range(len(target.get_decoder().layers)) if index not in kept]
    if skipped != recorded:
        return f"it skips the target's layers {skipped}, the head was trained for a draft skipping {recorded}"
    return None


def check_trained_for(head: AcceptanceHead, draft: Any, target: Any) -> None:
    """Refuse a draft (or, for a draft derived from the target, a target) that is provably not the one the head was
    trained for (`trained_for`, as `load_head` reads it from config.json): a derived draft must be the target's own
    tensors with the recorded layers skipped, and the target (or a draft of its own) what `weights_mismatch` can
    tell; where its identity cannot be determined from the model, nothing is refused (`load_head(...,
    expect_draft=)` checks a draft identity you give)."""
    recorded = (getattr(head, "trained_for", None) or {}).get("draft") or {}
    weights = recorded.get("weights") or {}
    name = recorded.get("name") or "its draft"
    if weights.get("derived_from_target"):
        differs = derived_mismatch(weights, draft, target)
        target_differs = None if differs else weights_mismatch(recorded.get("target_weights"), target)
        if target_differs:
            raise UsageError(f"this target is not the one the head's draft was derived from ({name}): {target_differs}; "
                             "pass that target (and the draft derived from it), or train a head for this one")
    else:
        differs = weights_mismatch(weights, draft)
    if differs:
        raise UsageError(f"this draft is not the one the head was trained for ({name}): {differs}; pass that draft "
                         "(and its target), or train a head for this one")


def check_drafter_for(head: AcceptanceHead, draft: Any) -> None:
    """Refuse a loaded head trained on data another draft labelled than this one, a feature drafter's above all: an
    EAGLE-3 or DSpark drafter of other files, another kind of draft, or a draft model
    (`specheads.decoding.drafters.generate_draft_refusal`). A head built in memory records nothing and passes."""
    recorded = getattr(head, "trained_for", None)
    refusal = None if recorded is None else generate_draft_refusal(recorded.get("draft") or {}, draft)
    if refusal:
        raise UsageError(f"this head cannot score this draft's candidates: {refusal}")


def generate_argument(name: str, accept: Callable[[Any], bool] | None = None) -> tuple[bool, Any]:
    """(found, value) of the argument `name` of the innermost running `generate` call (whose value `accept` takes,
    when given): what transformers 5.x does not hand a custom_generate callable can only be read off generate's
    frame."""
    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code and (accept is None or accept(frame.f_locals.get(name))):
                return True, frame.f_locals.get(name)
            frame = frame.f_back
        return False, None
    finally:
        del frame


def generate_streamer() -> Any:
    """The `streamer=` of the `generate` call running this callable (None when none was given or there is no such
    call): transformers 5.x puts the prompt into it and does not hand it to a custom_generate callable."""
    return generate_argument("streamer")[1]


def prompt_lookup(generation_config: Any) -> int | None:
    """transformers' `prompt_lookup_num_tokens` (K), or None where it is not set."""
    tokens = getattr(generation_config, "prompt_lookup_num_tokens", None)
    return int(tokens) if tokens else None


def free_draft_of(generation_config: Any, draft: Any, tree: Any) -> LookupDraft | None:
    """With `prompt_lookup_num_tokens=K`: the free draft to decode with, transformers' prompt lookup (its
    `max_matching_ngram_size`, 2 by default) or the `LookupDraft` given as draft= (a suffix draft); None without it."""
    if prompt_lookup(generation_config) is None:
        if isinstance(draft, LookupDraft):
            raise UsageError("a free draft drafts at most prompt_lookup_num_tokens tokens a round: give "
                             "prompt_lookup_num_tokens=K")
        return None
    if draft is not None and not isinstance(draft, LookupDraft):
        raise UsageError("prompt_lookup_num_tokens drafts from the context, not with a draft model: drop draft= (or "
                         "pass a LookupDraft, specheads.decoding.free_draft)")
    if tree is not None:
        raise UsageError("prompt lookup proposes one chain a round; drop tree=")
    ngram = getattr(generation_config, "max_matching_ngram_size", None) or 2
    return draft if draft is not None else LookupDraft("ngram", max_ngram=int(ngram))


def free_rule(generation_config: Any, estimator: Any) -> Any:
    """The rule of a free draft: its whole proposal up to K (transformers' prompt lookup) without head=; with one,
    an estimator of each proposed token's acceptance (a token-only head, `specheads.lookup.token_head.TokenHead`),
    the verify length that maximises the tokens a round emits over what its verify costs (`lookup_plan`, on this
    CPU's prepacked cost line)."""
    tokens = prompt_lookup(generation_config)
    if estimator is None:
        return make_policy("constant_k", tokens)
    if not callable(getattr(estimator, "estimates", None)):
        raise UsageError("with prompt_lookup_num_tokens, head= estimates each proposed token's acceptance from the "
                         "proposal (a token-only head: specheads.lookup.token_head.TokenHead.load(folder)); got "
                         f"{type(estimator).__name__}")
    if getattr(estimator, "target_state_size", 0):
        raise UsageError("this token head reads the target's state at the last verified position, which generate does "
                         "not feed it; use a token-only head trained without the target's state")
    return EstimatorPlanned(threshold=PACKED_CPU_TOKEN_COST, max_draft=tokens, estimator=estimator)


def check_options(generation_config: Any, model_kwargs: dict[str, Any], synced_gpus: bool, streamer: Any = None) -> None:
    """Refuse the generate options a speculative round cannot honour, one line each."""
    if streamer is not None:
        raise UsageError("transformers 5.x never hands generate's streamer= to a custom_generate callable (it would get "
                         "the prompt only); pass your streamer as token_streamer= instead")
    if getattr(generation_config, "num_beams", 1) > 1:
        raise UsageError("speculative_generate does not support beam search (num_beams > 1); use num_beams=1")
    mode = generation_config.get_generation_mode()
    if mode == GenerationMode.ASSISTED_GENERATION and prompt_lookup(generation_config):
        mode = GenerationMode.SAMPLE  # prompt lookup: drafted here, by `free_draft_of`
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        options = [name for name in ("penalty_alpha", "dola_layers", "constraints", "force_words_ids",
                                     "assistant_early_exit", "use_mtp")
                   if getattr(generation_config, name, None) not in (None, False, 0)]
        many = len(options) != 1
        raise UsageError(f"speculative_generate decodes by greedy search or sampling; {', '.join(options) or 'your options'} "
                         f"ask{'' if many else 's'} for {mode.value.replace('_', ' ')}, which it cannot honour: drop "
                         f"{'them' if many else 'it'}")
    inputs = sorted(name for name, value in model_kwargs.items() if value is not None and name not in PROMPT_KWARGS)
    if inputs:
        raise UsageError(f"speculative_generate decodes from the prompt's token ids alone and cannot honour "
                         f"{', '.join(inputs)}; use the target's own generate for those inputs")
    asked = [name for name in UNSUPPORTED_SWITCHES if getattr(generation_config, name, False)]
    if asked:
        raise UsageError(f"speculative_generate returns the token ids only; drop {', '.join(asked)}")
    if synced_gpus:
        raise UsageError("speculative_generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise UsageError("speculative_generate starts from the prompt; a prefilled cache is not supported")


def prompts_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's prompt without its left padding."""
    if attention_mask is None:
        return input_ids.tolist()
    if bool((attention_mask[:, -1] == 0).any()):
        raise UsageError("speculative_generate needs left-padded prompts; set tokenizer.padding_side = 'left'")
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


def length_limit(stopping_criteria: StoppingCriteriaList, generation_config: Any) -> int:
    """The total length `generate` allows (its MaxLengthCriteria, else the config's max_length)."""
    limits = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
    return min(limits) if limits else int(generation_config.max_length)


def stop_check_of(stopping_criteria: StoppingCriteriaList, stop_ids: set[int], padded: torch.Tensor,
                  device: torch.device) -> Callable[[int, list[int]], bool] | None:
    """The criteria other than the length limit and the EOS ids (the engine's stop ids), checked on one row's padded
    prompt plus its tokens so far; None when there are none."""
    others = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)
                                   and not (isinstance(c, EosTokenCriteria) and set(c.eos_token_id.tolist()) <= stop_ids)])
    if not others:
        return None

    def check(request: int, generated: list[int]) -> bool:
        ids = torch.cat([padded[request], torch.tensor(generated, dtype=padded.dtype)]).unsqueeze(0).to(device)
        return bool(others(ids, None).any())

    return check


def speculative_generate(model: Any, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                         stopping_criteria: StoppingCriteriaList, generation_config: Any, synced_gpus: bool = False,
                         streamer: Any = None, draft: Any = None, head: Any = None, token_streamer: Any = None,
                         stats: list[DecodeResult] | None = None, cost_ratio: float | None = None,
                         tree: TreeRule | dict[str, Any] | None = None, **model_kwargs: Any) -> torch.LongTensor:
    """A `custom_generate` callable for `target.generate`: speculative decoding with `draft` and the exported `head`
    (module docstring). Returns the sequences as `generate` does (prompt, new tokens, then pad ids where a row ended
    early); `stats`, when given, receives each row's `DecodeResult` (forwards, target calls, tokens). `cost_ratio`:
    your t_draft/t_target, for a head whose rule is read from the costs (`rule_policy`) or for a tree's growth.
    `tree`: tree drafts under that `TreeRule` (or dict of its fields) in place of the head's chain rule."""
    check_cost_ratio(cost_ratio)
    rule_of_tree = tree_rule(tree, cost_ratio)
    free = free_draft_of(generation_config, draft, rule_of_tree)
    module, policy = None, own_rule(draft) if head is None and rule_of_tree is None else None
    if free is not None:
        draft, policy = free, free_rule(generation_config, head)
    elif policy is None and (head is not None or rule_of_tree is None or rule_of_tree.reads_head):
        module, rule = resolve_head(head)
        policy = rule_policy(rule, cost_ratio) if rule_of_tree is None else None
    check_options(generation_config, model_kwargs, synced_gpus, streamer if streamer is not None else generate_streamer())
    transform = sampling_of(logits_processor, bool(generation_config.do_sample))
    check_draft(draft)
    if module is not None:
        check_pair(module, draft, transform)
        check_decodable_head(module)
        check_trained_for(module, draft, model)
        check_drafter_for(module, draft)
    if token_streamer is not None and input_ids.shape[0] > 1:
        raise UsageError("token_streamer streams one sequence; generate one prompt at a time to stream")
    prompts = prompts_of(input_ids, model_kwargs.get("attention_mask"))
    max_new_tokens = length_limit(stopping_criteria, generation_config) - input_ids.shape[1]
    stop_ids = stop_ids_of(generation_config)
    seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()  # torch's global RNG: torch.manual_seed repeats a run
    engine = RoundEngine(model, draft, transform, stop_ids)

    def emit(request: int, tokens: list[int]) -> None:
        token_streamer.put(torch.tensor(tokens))

    if token_streamer is not None:  # as generate does with its own streamer: the prompt first (skip_prompt drops it)
        token_streamer.put(input_ids.cpu())
    on_device = None if module is None else module.to(next(draft.parameters()).device)
    stop_check = stop_check_of(stopping_criteria, set(stop_ids), input_ids.cpu(), input_ids.device)
    on_emit = emit if token_streamer is not None else None
    if rule_of_tree is not None:
        results = decode_tree(engine, prompts, rule_of_tree, max_new_tokens, seeds, on_device, stop_check=stop_check,
                              on_emit=on_emit, batch_size=len(prompts))
    else:
        results = engine.decode(prompts, policy, max_new_tokens, seeds, on_device, stop_check=stop_check, on_emit=on_emit)
    if token_streamer is not None:
        token_streamer.end()
    if stats is not None:
        stats.extend(results)
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else (stop_ids or [0])[0]
    return with_new_tokens(input_ids, results, int(pad))


def stop_ids_of(generation_config: Any) -> list[int]:
    """The token ids that end a sequence: `generation_config.eos_token_id` as one id, a list or a tensor of them."""
    eos = generation_config.eos_token_id
    if isinstance(eos, torch.Tensor):
        return [int(i) for i in eos.flatten().tolist()]
    return [] if eos is None else [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos])]


def with_new_tokens(input_ids: torch.LongTensor, results: list[DecodeResult], pad: int) -> torch.LongTensor:
    """The sequences as `generate` returns them: each prompt row, its new tokens, then `pad` where it ended early."""
    width = max(len(r.tokens) for r in results) if results else 0
    new = torch.full((len(results), width), pad, dtype=input_ids.dtype)
    for row, result in enumerate(results):
        new[row, : len(result.tokens)] = torch.tensor(result.tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)
