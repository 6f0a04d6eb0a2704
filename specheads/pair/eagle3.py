"""EAGLE-3 drafters in speculators' format (vllm-project/speculators, the `eagle3` extra): build one for a target,
read the target features it conditions on, and save or load its folder.

An EAGLE-3 drafter reads, at every position, the target's residual stream entering three of its layers (concatenated,
then projected by `fc`), plus the embedding of the next token; one decoder layer and an LM head over a reduced draft
vocabulary predict the token after. `d2t` maps a draft index to the target's token (`target = draft + d2t[draft]`) and
`t2d` marks the target tokens the draft vocabulary holds. speculators' folder is `config.json` (its
`speculators_model_type`) and `model.safetensors`; the embedding is the target's and is not saved (vLLM and speculators
take it from the target), nor are the target's final norm and LM head, which only training reads.

speculators is imported only here, and only when a drafter is built or loaded.
"""

from __future__ import annotations

import copy
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


def speculators_eagle3() -> Any:
    """speculators' eagle3 module (`Eagle3DraftModel`, `Eagle3SpeculatorConfig`), or a UsageError with the install line."""
    try:
        from speculators.models import eagle3
    except ImportError as error:
        raise UsageError(f"EAGLE-3 drafters need speculators ({error.name or error} is missing); {INSTALL_HINT}") from None
    return eagle3


def default_layer_ids(num_layers: int) -> list[int]:
    """The target layers EAGLE-3 fuses by default (vLLM's and speculators' choice): 2, the middle one, and the third
    from the end."""
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids: list[int], count: int, flag: str = "layer_ids") -> list[int]:
    """`layer_ids`, refused unless three distinct ids of a target with `count` layers (0..count: id i reads the
    stream entering layer i, id count the last layer's output)."""
    if len(layer_ids) != 3 or len(set(layer_ids)) != 3 or not all(0 <= i <= count for i in layer_ids):
        raise UsageError(f"{flag} {layer_ids} must be three distinct target layers in 0..{count}; the default is "
                         f"{default_layer_ids(count)}")
    return layer_ids


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


def build_drafter(target_config: Any, layer_ids: list[int], draft_vocab_size: int, verifier: str,
                  num_layers: int = 1, ttt_steps: int = 3, attention: str = "eager") -> torch.nn.Module:
    """A freshly initialised `Eagle3DraftModel` for a target with config `target_config` (a Llama or Qwen3 config):
    `num_layers` decoder layers shaped as the target's, fusing `layer_ids`, predicting over `draft_vocab_size`
    tokens; `verifier` is the target's name as the folder records it (a Hub id vLLM can load). Its embedding, LM head
    and vocabulary maps are empty until `fill_from_target`."""
    eagle3 = speculators_eagle3()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    check_layer_ids(layer_ids, target_config.num_hidden_layers)
    layer_config = copy.deepcopy(target_config)
    layer_config.num_hidden_layers = num_layers
    layer_config._attn_implementation = attention
    config = eagle3.Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=draft_vocab_size, eagle_aux_hidden_state_layer_ids=layer_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(target_config.architectures or []))))
    return eagle3.Eagle3DraftModel(config)


def fill_from_target(drafter: torch.nn.Module, target: torch.nn.Module, d2t: torch.Tensor | None = None,
                     t2d: torch.Tensor | None = None) -> torch.nn.Module:
    """Give `drafter` the target's embedding, final norm and LM head (its rows of the draft vocabulary), with the
    vocabulary maps `d2t`/`t2d` when given (else the ones it holds); all of them frozen. Returns `drafter`."""
    if d2t is not None and t2d is not None:
        drafter.load_vocab_mappings(t2d.to(torch.bool), d2t.to(torch.long))
    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    rows = draft_to_target(drafter.d2t.to(head.device))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embedding)
        drafter.verifier_lm_head.weight.copy_(head[rows])
        drafter.verifier_norm.weight.copy_(target.get_decoder().norm.weight)
        if drafter.lm_head.weight.isnan().any():  # speculators starts the draft head from the target's rows
            drafter.lm_head.weight.copy_(head[rows])
    for module in (drafter.embed_tokens, drafter.verifier_lm_head, drafter.verifier_norm, drafter.lm_head):
        module.weight.requires_grad_(False)
    return drafter


def save_drafter(drafter: torch.nn.Module, folder: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write `drafter` as speculators does (config.json + model.safetensors), in `dtype`, without the target's
    weights (`NOT_SAVED`): vLLM and speculators' `from_pretrained` read this folder."""
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
             for name, tensor in drafter.state_dict().items() if name not in NOT_SAVED and "rotary_emb" not in name}
    drafter.save_pretrained(folder, state_dict=state, safe_serialization=True)


def load_drafter(folder: str | Path, target: torch.nn.Module, attention: str = "eager") -> torch.nn.Module:
    """The drafter saved in `folder` (speculators' format), completed with `target`'s weights, in eval mode, frozen,
    in the target's dtype and on its device. Nothing but config.json and safetensors is read; the verifier it names is
    not fetched."""
    eagle3 = speculators_eagle3()
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise UsageError(f"{folder} is not an EAGLE-3 drafter folder (config.json and model.safetensors); give the "
                         "folder `specheads train drafter` or speculators wrote")
    config = eagle3.Eagle3SpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = attention
    drafter = eagle3.Eagle3DraftModel(config)
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in NOT_SAVED and "rotary_emb" not in name]
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
    vLLM hands them to an EAGLE-3 drafter: layer id i reads the stream entering layer i)."""
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


def fused_streams(captured: dict[int, torch.Tensor], layer_ids: list[int]) -> torch.Tensor:
    """The streams `streams_captured` kept for `layer_ids`, concatenated in that order [..., 3h]: what `fc` fuses."""
    return torch.cat([captured[index] for index in layer_ids], dim=-1)


def target_features(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the streams entering `layer_ids`, concatenated [B, L, 3h]; the last layer's output before the final norm
    [B, L, h]) from one forward of the target's decoder (`streams_captured`)."""
    with streams_captured(target, layer_ids) as captured, torch.no_grad():
        target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    last = len(target.get_decoder().layers)
    return fused_streams(captured, layer_ids), captured[last]


def drafter_forward(drafter: torch.nn.Module, input_ids: torch.Tensor, features: torch.Tensor,
                    mask: torch.Tensor | None, positions: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's decoder over `input_ids` [B, m], each token beside its feature row [B, m, h] (the target's streams
    after `fc`, or the drafter's own states), at `positions` [B, m] under the additive attention `mask` (None: the
    layers' own), its keys and values added to `cache`: (the normed states its LM head reads, the states a drafted
    token is read back with: the normed ones where the drafter was trained so, `norm_output`)."""
    embedded = drafter.embed_tokens(input_ids)
    hidden = torch.cat([embedded, features.to(embedded.dtype)], dim=-1)
    embeddings = drafter.rotary_emb(hidden, positions)
    for layer in drafter.layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                       position_embeddings=embeddings)
    normed = drafter.norm(hidden)
    return normed, normed if drafter.config.norm_output else hidden
