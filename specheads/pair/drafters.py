"""What the drafters in speculators' format (vllm-project/speculators, the `eagle3` extra) share, whatever their
algorithm (`specheads.pair.eagle3`, `specheads.pair.dspark`): the target features they read, their vocabulary maps,
the target's weights they hold, and their folder.

A drafter reads the target's residual stream at a few layers (layer id i: the stream entering layer i, id L the last
layer's output before the final norm, as vLLM hands them over) and predicts over a draft vocabulary: `d2t` maps a draft
index to the target's token (`target = draft + d2t[draft]`), `t2d` marks the target tokens it holds; a drafter over
the target's whole vocabulary has neither. Its folder is `config.json` (`speculators_model_type` names the algorithm)
and `model.safetensors`; the target's embedding, final norm and LM head are not saved (vLLM and speculators take them
from the target) and are filled from the target on loading.

speculators is imported only here and in the algorithm modules, and only when a drafter is built or loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from specheads.plumbing.errors import UsageError

INSTALL_HINT = ("install the eagle3 extra and speculators without its dependencies: `sh scripts/install.sh eagle3`, or "
                "`pip install \"specheads[eagle3]\" && pip install --no-deps speculators==0.9.0`")
NOT_SAVED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
"""The target's own weights inside a drafter: filled from the target, never written to the drafter's folder."""
FORWARD_MODULES = ("fc", "hidden_norm", "layers", "norm", "lm_head")
"""The drafter's modules one of its forwards runs on the tokens it reads, EAGLE-3's and DSpark's (the decoding core's
`specheads.decoding.eagle3` and `.dspark`): the fusion layer on the target's streams (and DSpark's norm after it), the
decoder layers, the final norm, the LM head. `verifier_lm_head` and `verifier_norm` (the target's, read only by
training's loss) and `embed_tokens` (a lookup) multiply nothing at decoding."""
CANDIDATE_MODULES = ("markov_head", "confidence_head")
"""A DSpark drafter's modules that run once per candidate drawn, after the block's forward: the Markov head's bias
(`markov_w2` over the draft vocabulary, its gate or recurrent projection) and the confidence head."""


def speculators_models(algorithm: str) -> Any:
    """speculators' module of `algorithm` (`speculators.models.eagle3`, `.dspark`), or a UsageError with the install
    line."""
    try:
        from importlib import import_module

        import_module("speculators.models")  # through the parent: a submodule already imported would hide its absence
        return import_module(f"speculators.models.{algorithm}")
    except ImportError as error:
        raise UsageError(f"{algorithm} drafters need speculators ({error.name or error} is missing); {INSTALL_HINT}") from None


def default_layer_ids(num_layers: int) -> list[int]:
    """The target layers a drafter reads by default (vLLM's and speculators' choice for EAGLE-3 and DSpark): 2, the
    middle one, and the third from the end."""
    return [2, num_layers // 2, num_layers - 3]


def vocab_maps(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary of the `size` most frequent target tokens by `counts` (one count per target
    token; ties go to the lower id), as speculators builds them: d2t holds offsets, t2d a mask over the target's."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if not 0 < size <= counts.numel():
        raise UsageError(f"draft_vocab_size {size} must be between 1 and the target's vocabulary ({counts.numel()})")
    frequencies = {int(token): int(count) for token, count in enumerate(counts.tolist()) if count > 0}
    return build_vocab_mappings_from_distribution(frequencies, size, counts.numel())


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """The target token id of every draft index (d2t stores offsets)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def draft_rows(drafter: Any) -> torch.Tensor:
    """The target token id of each of the drafter's output rows: by its d2t, or every token for a drafter over the
    target's whole vocabulary."""
    if drafter.d2t is None:
        return torch.arange(drafter.lm_head.weight.shape[0], device=drafter.lm_head.weight.device)
    return draft_to_target(drafter.d2t)


def fill_from_target(drafter: torch.nn.Module, target: torch.nn.Module, d2t: torch.Tensor | None = None,
                     t2d: torch.Tensor | None = None) -> torch.nn.Module:
    """Give `drafter` the target's embedding, final norm and LM head (its rows of the draft vocabulary), with the
    vocabulary maps `d2t`/`t2d` when given (else the ones it holds); all of them frozen. Returns `drafter`."""
    if d2t is not None and t2d is not None:
        drafter.load_vocab_mappings(t2d.to(torch.bool), d2t.to(torch.long))
    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    rows = draft_rows(drafter).to(head.device)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embedding)
        drafter.verifier_lm_head.weight.copy_(head[rows])
        drafter.verifier_norm.weight.copy_(target.get_decoder().norm.weight)
        if drafter.lm_head.weight.isnan().any():  # speculators starts the draft head from the target's rows
            drafter.lm_head.weight.copy_(head[rows])
    for module in (drafter.embed_tokens, drafter.verifier_lm_head, drafter.verifier_norm, drafter.lm_head):
        module.weight.requires_grad_(False)
    return drafter


def weights_run(drafter: torch.nn.Module, modules: tuple[str, ...]) -> int:
    """The weights the drafter's `modules` (those it has) multiply per token they read: their parameters but lookup
    tables (an `Embedding`'s, the Markov head's `markov_w1`)."""
    count = 0
    for name in modules:
        module = getattr(drafter, name, None)
        if module is None:
            continue
        lookups = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
        count += sum(p.numel() for p in module.parameters() if id(p) not in lookups)
    return count


def forward_weights(drafter: torch.nn.Module) -> int:
    """The weights one drafter forward multiplies per token it reads (`FORWARD_MODULES`): what its draft forward is
    priced by. For SmolLM2-135M's EAGLE-3 drafter (one layer, 8192 draft tokens) 9.81 M; counting every parameter but
    the embedding would add the training-only `verifier_lm_head`'s 4.72 M."""
    return weights_run(drafter, FORWARD_MODULES)


def candidate_weights(drafter: torch.nn.Module) -> int:
    """The weights a DSpark drafter multiplies for each candidate it draws after its block's forward
    (`CANDIDATE_MODULES`: the Markov bias, 2.1 M at rank 256 over 8192 draft tokens, and the confidence head); none
    for a drafter without them (EAGLE-3)."""
    return weights_run(drafter, CANDIDATE_MODULES)


def not_saved(drafter: torch.nn.Module) -> set[str]:
    """The drafter's weights its folder leaves out: the target's (`NOT_SAVED`), and what its class leaves out too (a
    DSpark drafter over the target's whole vocabulary: the LM head, which is the target's)."""
    return {*NOT_SAVED, *getattr(drafter, "_keys_to_ignore_on_save", [])}


def save_drafter(drafter: torch.nn.Module, folder: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write `drafter` as speculators does (config.json + model.safetensors), in `dtype`, without the target's
    weights (`not_saved`): vLLM and speculators' `from_pretrained` read this folder."""
    left_out = not_saved(drafter)
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
             for name, tensor in drafter.state_dict().items() if name not in left_out and "rotary_emb" not in name}
    drafter.save_pretrained(folder, state_dict=state, safe_serialization=True)


def check_drafter_folder(folder: str | Path, algorithm: str) -> None:
    """Refuse in one line a folder that holds no `algorithm` drafter in speculators' format (config.json naming it and
    model.safetensors); reads config.json only (`specheads.pair.drafter_checks.read_config`)."""
    from specheads.pair.drafter_checks import read_config

    read_config(folder, algorithm)


def load_drafter(folder: str | Path, target: torch.nn.Module, algorithm: str, config_class: str,
                 build: Any) -> torch.nn.Module:
    """The `algorithm` drafter saved in `folder` (speculators' format), read with speculators' `config_class` and made
    by `build(config)`, completed with `target`'s weights, in eval mode, frozen, in the target's dtype and on its
    device. Nothing but config.json and safetensors is read; the verifier it names is not fetched. A folder of another
    algorithm is refused in one line."""
    from safetensors.torch import load_file

    module = speculators_models(algorithm)
    folder = Path(folder)
    check_drafter_folder(folder, algorithm)
    drafter = build(getattr(module, config_class).from_pretrained(str(folder)))
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    allowed = {*NOT_SAVED, *getattr(drafter, "_keys_to_ignore_on_load_missing", [])}
    missing = [name for name in missing if name not in allowed and "rotary_emb" not in name]
    if missing or unexpected:
        raise UsageError(f"{folder}/model.safetensors does not fit its config.json (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}); give a folder saved by speculators or `specheads train drafter`")
    parameter = next(target.parameters())
    fill_from_target(drafter.to(parameter.device), target)
    return drafter.to(parameter.dtype).eval().requires_grad_(False)


@contextmanager
def streams_captured(target: torch.nn.Module, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """While open, every forward of the target's decoder leaves in the yielded dict, by layer id, the residual stream
    entering each layer of `layer_ids` and, under the layer count, the last layer's output before the final norm (as
    vLLM hands them to a drafter: layer id i reads the stream entering layer i)."""
    decoder = target.get_decoder()
    layers = decoder.layers
    captured: dict[int, torch.Tensor] = {}

    def keeper(index: int) -> Any:
        def keep(module: Any, args: tuple, kwargs: dict) -> None:
            captured[index] = args[0] if args else kwargs["hidden_states"]
        return keep

    points = {index: layers[index] if index < len(layers) else decoder.norm for index in {*layer_ids, len(layers)}}
    hooks = [module.register_forward_pre_hook(keeper(index), with_kwargs=True) for index, module in points.items()]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def target_features(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the streams entering `layer_ids`, concatenated [B, L, n·h]; the last layer's output before the final norm
    [B, L, h]) from one forward of the target's decoder (`streams_captured`)."""
    with streams_captured(target, layer_ids) as captured, torch.no_grad():
        target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    last = len(target.get_decoder().layers)
    return torch.cat([captured[index] for index in layer_ids], dim=-1), captured[last]


def drafter_weights_sha256(folder: str | Path) -> str:
    """The digest of a drafter folder's files (config.json and safetensors, whole), as the data fingerprint records it."""
    from specheads.pair.digests import cached_weights_sha256
    from specheads.pair.models import ModelSpec, local_weights_sha256, resolve_source

    return local_weights_sha256(resolve_source(ModelSpec(path=str(folder))), cached_weights_sha256)


def labelled_by_drafter(draft_identity: dict[str, Any], kind: str, folder: str | Path) -> bool:
    """Whether the data whose fingerprint records `draft_identity` (its manifest's draft) was labelled by the `kind`
    drafter in `folder`: the same kind and the same files (`drafter_weights_sha256`)."""
    return draft_identity.get("kind") == kind and draft_identity.get("weights_sha256") == drafter_weights_sha256(folder)
