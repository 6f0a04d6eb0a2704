"""Loading models from their specs (`specheads.pair.model_spec.ModelSpec`, importable from here too): a Hub id or local
folder, a GGUF file, the embedded default, or a derived draft.

A derived draft is the target with a block of decoder layers skipped (self-speculative). It gets
its own module objects with renumbered cache indices but shares the target's weight tensors, so it
costs no extra memory and never writes into the target's KV cache.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specheads.model_outputs.signals import output_width
from specheads.pair.digests import cached_sha256, cached_weights_sha256
from specheads.pair.embedded import EMBEDDED_NAME, embedded_folder
from specheads.pair.model_spec import ModelSpec
from specheads.pair.placement import (
    PLACEMENT_FIELDS,
    RankDevices,
    check_no_spill,
    load_kwargs,
    offloaded_weights,
    visible_devices,
)
from specheads.plumbing.errors import UsageError
from specheads.plumbing.hub import hub_unreachable, reach_fix

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ResolvedSource:
    """A spec turned into arguments for `from_pretrained`."""

    location: str
    revision: str | None
    gguf_file: str | None
    is_local: bool


def resolve_source(spec: ModelSpec) -> ResolvedSource:
    """Map a spec's `path` to a folder or Hub id plus GGUF file name (converting the embedded model once)."""
    path = spec.path
    if path is None:
        raise UsageError("model path is empty: name a Hub id, a local folder, a .gguf file or embedded:smollm2")
    if path == EMBEDDED_NAME:
        return ResolvedSource(str(embedded_folder()), None, None, True)
    local = Path(path).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return ResolvedSource(str(local.parent), None, local.name, True)
    if path.endswith(".gguf") or path.startswith(("/", "./", "../", "~")):
        if not local.exists():
            raise UsageError(f"model path {path!r} does not exist; give an existing folder or .gguf file")
    return ResolvedSource(str(local) if local.is_dir() else path, spec.revision, spec.gguf_file, local.is_dir())


def hub_offline(source: ResolvedSource) -> str | None:
    """Why a Hub source must come from the local cache (`specheads.plumbing.hub`: offline mode, or no connection); None for a
    local source or a reachable Hub."""
    return None if source.is_local else hub_unreachable()


def _load_error(spec: ModelSpec, error: Exception, offline: str | None = None) -> UsageError:
    """One whole line: why `spec` could not be loaded and the fix (the Hub's own error text is kept entire)."""
    if offline:
        return UsageError(f"cannot load model {spec.path!r}: it is not a local folder or file, nor in the Hugging Face "
                          f"cache, and the Hub cannot be used ({offline}); {reach_fix()}, or pass a local folder or .gguf file")
    reason = " ".join(str(error).split())
    return UsageError(
        f"cannot load model {spec.path!r}: it is not a local folder or file and could not be fetched from the Hub "
        f"({type(error).__name__}: {reason}); check the id, pass a local folder, or connect to the network"
    )


def _placement_error(spec: ModelSpec, error: Exception) -> UsageError:
    reason = " ".join(str(error).split())[:300]
    return UsageError(f"cannot place model {spec.describe()!r} with device_map {spec.device_map} and max_memory "
                      f"{spec.max_memory} ({type(error).__name__}: {reason}); fix the map, or raise gpus_per_rank or max_memory")


def load_tokenizer(spec: ModelSpec) -> Any:
    """The spec's tokenizer (cheap: loaded before any model so mismatches are refused early)."""
    from transformers import AutoTokenizer

    source = resolve_source(spec)
    offline = hub_offline(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, revision=source.revision, gguf_file=source.gguf_file,
                                                  local_files_only=offline is not None)
    except (OSError, ValueError) as error:
        raise _load_error(spec, error, offline) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_hash(tokenizer: Any) -> str:
    """Hash of the vocabulary and special tokens: equal hashes mean p and q index the same tokens."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()[:16]


def chat_template_hash(tokenizer: Any) -> str | None:
    """Hash of the tokenizer's chat template (None when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    return hashlib.sha256(str(template).encode()).hexdigest()[:16]


def check_same_tokenizer(target_name: str, target_tok: Any, draft_name: str, draft_tok: Any) -> None:
    """Refuse a pair whose tokenizers differ, naming both."""
    target_hash, draft_hash = tokenizer_hash(target_tok), tokenizer_hash(draft_tok)
    if target_hash != draft_hash:
        raise UsageError(
            f"draft {draft_name!r} and target {target_name!r} use different tokenizers or vocabularies "
            f"({len(draft_tok)} vs {len(target_tok)} tokens, hashes {draft_hash} vs {target_hash}); "
            "pick a draft from the target's model family"
        )


def load_model(spec: ModelSpec, devices: RankDevices | None = None) -> torch.nn.Module:
    """Load a causal LM in eval mode with frozen weights (skipping `spec.skip_layers` if any).

    With `devices` (a gen rank's) the model lands there: spread over its GPUs by `spec.device_map`, else whole on its
    root device. Without, it stays on the CPU unless `spec.device_map` spreads it over the visible GPUs."""
    from transformers import AutoModelForCausalLM

    if spec.dtype not in DTYPES:
        raise UsageError(f"unknown dtype {spec.dtype!r}; use one of {', '.join(DTYPES)}")
    source = resolve_source(spec)
    where = devices or visible_devices()
    placement = load_kwargs(spec, where)
    offline = hub_offline(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.location, revision=source.revision, gguf_file=source.gguf_file, dtype=DTYPES[spec.dtype],
            local_files_only=offline is not None, **placement
        )
    except OSError as error:
        raise _load_error(spec, error, offline) from error
    except ValueError as error:
        raise (_placement_error(spec, error) if placement else _load_error(spec, error, offline)) from error
    except RuntimeError as error:  # with a placement: accelerate's refusals (a GGUF spilling to disk, …)
        if not placement or isinstance(error, torch.OutOfMemoryError):
            raise
        raise _placement_error(spec, error) from error
    if placement:
        check_no_spill(spec, model, where)
    elif devices is not None:
        model.to(devices.root)
    model.eval().requires_grad_(False)
    return without_layers(model, spec.skip_layers) if spec.skip_layers else model


def without_layers(model: torch.nn.Module, skip: list[int]) -> torch.nn.Module:
    """A copy of `model` with decoder layers `skip` removed; weights are shared, modules and config are not."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UsageError(f"cannot skip layers of {type(model).__name__}: its decoder has no `layers` list")
    count = len(layers)
    bad = [i for i in skip if not 0 <= i < count]
    if bad or len(set(skip)) >= count:
        raise UsageError(f"skip_layers {skip} is invalid for a model with {count} layers (0..{count - 1}, keep at least one)")
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    shared.update(offloaded_weights(model))  # a split target's offloaded weights: shared too, never copied
    draft = copy.deepcopy(model, memo=shared)
    draft_decoder = draft.get_decoder()
    kept = [layer for index, layer in enumerate(draft_decoder.layers) if index not in set(skip)]
    draft_decoder.layers = torch.nn.ModuleList(kept)
    for new_index, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    config = draft.config
    if getattr(config, "layer_types", None):
        config.layer_types = [kind for index, kind in enumerate(config.layer_types) if index not in set(skip)]
    config.num_hidden_layers = len(kept)
    return draft


TENSOR_PROBE = 256
"""How many leading elements of two tensors that are not the same storage `same_tensor` compares."""


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether `a` and `b` hold the same weights: the same tensor or storage, or equal shape, dtype and leading
    `TENSOR_PROBE` elements (a copy of the same weights loaded apart); None where that cannot be told (weights
    offloaded to the meta device)."""
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return None
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a.detach().reshape(-1)[:TENSOR_PROBE].cpu(), b.detach().reshape(-1)[:TENSOR_PROBE].cpu())


def same_weights(ours: list[torch.Tensor], theirs: list[torch.Tensor], identical: bool = False) -> bool | None:
    """`same_tensor` over two lists of tensors, pairwise (with `identical`, the very same objects): False at the first
    that differs, None if any is undecided."""
    if len(ours) != len(theirs):
        return False
    verdicts = [a is b if identical else same_tensor(a, b) for a, b in zip(ours, theirs)]
    return False if False in verdicts else (None if None in verdicts else True)


def derived_layers(draft: torch.nn.Module, target: torch.nn.Module, identical: bool = False) -> list[int] | None | bool:
    """Which of the target's decoder layers the draft's are, in order, when the draft is the target with layers
    skipped (`without_layers`: its tensors are the target's own, so this reads no weights); None when a draft layer,
    its embeddings, final norm or output layer are not the target's; False where it cannot be told (no `layers`
    list, or weights offloaded to the meta device). With `identical`, only the target's very parameter objects count
    as its own (what a pass that runs the target's modules for the draft needs: `data_gen.onepass`)."""
    ours, theirs = (getattr(model.get_decoder(), "layers", None) for model in (draft, target))
    if not isinstance(ours, torch.nn.ModuleList) or not isinstance(theirs, torch.nn.ModuleList):
        return False
    in_layers = {id(p) for layer in ours for p in layer.parameters()}
    named = dict(target.named_parameters())
    outside = [(name, p) for name, p in draft.named_parameters() if id(p) not in in_layers]
    if any(name not in named for name, _ in outside):
        return None
    verdict = same_weights([p for _, p in outside], [named[name] for name, _ in outside], identical)
    if not verdict:
        return None if verdict is False else False
    kept, start = [], 0
    for layer in ours:
        weights = list(layer.parameters())
        for index in range(start, len(theirs)):
            verdict = same_weights(weights, list(theirs[index].parameters()), identical)
            if verdict is None:
                return False
            if verdict:
                kept.append(index)
                start = index + 1
                break
        else:
            return None
    return kept


def vocab_rows(model: torch.nn.Module) -> int:
    """The size of p and q: the output projection's rows less the padding its forward drops (`output_width`)."""
    width = output_width(model)
    if width is None:
        raise UsageError(f"{type(model).__name__} has no output layer to read p or q from; use a causal LM")
    return width


def check_same_vocab(target_name: str, target: torch.nn.Module, draft_name: str, draft: torch.nn.Module) -> None:
    """Refuse a pair whose output layers have different vocabulary sizes (checked before any forward)."""
    if vocab_rows(target) != vocab_rows(draft):
        raise UsageError(
            f"draft {draft_name!r} predicts {vocab_rows(draft)} tokens but target {target_name!r} predicts "
            f"{vocab_rows(target)}; pick a draft with the target's vocabulary"
        )


WEIGHT_SUFFIXES = {".safetensors", ".bin", ".gguf", ".json"}
"""The files of a local model folder that its fingerprint hashes."""


def hub_commit(source: ResolvedSource) -> str | None:
    """The commit of the cached Hub snapshot `from_pretrained` read (transformers 5 no longer puts it on the config)."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source.location, source.gguf_file or "config.json", revision=source.revision)
    if not isinstance(cached, str):
        return None
    parts = Path(cached).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


def weights_identity(spec: ModelSpec, model: torch.nn.Module) -> dict:
    """What identifies the weights: the Hub commit, or the sha256 of every local weight and config file, whole (a
    safetensors header's metadata in sorted order; `specheads.pair.digests`: computed once per file version, then
    cached). Where the model runs is no part of it."""
    spec_fields = {name: value for name, value in asdict(spec).items() if name not in PLACEMENT_FIELDS}
    identity: dict[str, Any] = {"spec": spec_fields, "class": type(model).__name__}
    source = resolve_source(spec)
    commit = None if source.is_local else hub_commit(source)
    if commit:
        identity["revision"] = commit
        return identity
    identity["weights_sha256"] = local_weights_sha256(source, cached_weights_sha256)
    return identity


def local_weights_sha256(source: ResolvedSource, file_digest: Callable[[Path], str]) -> str:
    """The short digest of a local model's weight and config files (the GGUF alone for a GGUF), each by
    `file_digest`."""
    folder = Path(source.location)
    files = ([folder / source.gguf_file] if source.gguf_file else
             [file for file in sorted(folder.iterdir()) if file.suffix in WEIGHT_SUFFIXES and file.is_file()])
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}:{file_digest(file)}\n".encode())
    return digest.hexdigest()[:16]


def whole_file_weights_sha256(spec: ModelSpec) -> str:
    """A local model's `weights_sha256` as specheads recorded it before a safetensors header's metadata keys were
    sorted (every file hashed as its bytes), for records made then."""
    return local_weights_sha256(resolve_source(spec), cached_sha256)


def context_length(model: torch.nn.Module) -> int:
    """The longest sequence the model's positions support."""
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)


@dataclass
class ModelPair:
    """A loaded draft/target pair that shares one tokenizer."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    target_name: str
    draft_name: str


def derived_draft(spec: ModelSpec) -> bool:
    """True when the draft spec names no model of its own: it is the target minus `skip_layers`."""
    return spec.path is None


def draft_weights_identity(spec: ModelSpec, model: torch.nn.Module) -> dict:
    """The draft's weights as data and export record them: its own weights, or, for a draft derived from the target,
    which layers it skips (the target's weights are recorded beside it)."""
    if derived_draft(spec):
        return {"derived_from_target": True, "skip_layers": sorted(spec.skip_layers)}
    return weights_identity(spec, model)


def draft_identity(spec: ModelSpec, model: torch.nn.Module, state_layer: int | None = None,
                   target: tuple[ModelSpec, torch.nn.Module] | None = None) -> dict:
    """What a head's config.json says about the draft it reads: name, weights and state layer, plus the target's
    weights for a draft derived from the target (two such drafts of different targets share name and skipped layers).
    It is the form `heads.load_head(..., expect_draft=...)` compares."""
    identity = {"name": spec.describe(), "weights": draft_weights_identity(spec, model), "state_layer": state_layer}
    if derived_draft(spec):
        if target is None:
            raise UsageError(f"draft {spec.describe()} is derived from the target: pass target=(target_spec, target_model)"
                             " so that its identity names the target's weights")
        identity["target_weights"] = weights_identity(*target)
    return identity


def load_tokenizers(target_spec: ModelSpec, draft_spec: ModelSpec) -> Any:
    """The pair's shared tokenizer; refuses mismatched tokenizers before any model is loaded."""
    target_tok = load_tokenizer(target_spec)
    if derived_draft(draft_spec):
        if not draft_spec.skip_layers:
            raise UsageError("draft.path is empty and draft.skip_layers is empty: name a draft model or the target layers to skip")
        return target_tok
    check_same_tokenizer(target_spec.describe(), target_tok, draft_spec.describe(), load_tokenizer(draft_spec))
    return target_tok


def load_pair(target_spec: ModelSpec, draft_spec: ModelSpec, tokenizer: Any | None = None,
              devices: RankDevices | None = None) -> ModelPair:
    """Load draft and target (onto a gen rank's `devices` when given, `load_model`), refusing a tokenizer or
    vocabulary mismatch before any compute."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizers(target_spec, draft_spec)
    target = load_model(target_spec, devices)
    if derived_draft(draft_spec):
        draft = without_layers(target, draft_spec.skip_layers)
    else:
        draft = load_model(draft_spec, devices)
    check_same_vocab(target_spec.describe(), target, draft_spec.describe(), draft)
    return ModelPair(target, draft, tokenizer, target_spec.describe(), draft_spec.describe())


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a response (the model's generation config, else the tokenizer's EOS)."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    ids = [i for i in ids if i is not None] or [tokenizer.eos_token_id]
    return ids


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """Tokens up to and including the first stop token."""
    for position, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: position + 1]
    return tokens
