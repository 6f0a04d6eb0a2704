"""EAGLE-3 drafters in speculators' format (vllm-project/speculators, the `eagle3` extra): build one for a target,
read the target features it conditions on, and save or load its folder.

An EAGLE-3 drafter reads, at every position, the target's residual stream entering three of its layers (concatenated,
then projected by `fc`), plus the embedding of the next token; one decoder layer and an LM head over a reduced draft
vocabulary predict the token after. `d2t` maps a draft index to the target's token (`target = draft + d2t[draft]`) and
`t2d` marks the target tokens the draft vocabulary holds. What every drafter in speculators' format shares (the
target features, the vocabulary maps, the target's weights, the folder) is in `specheads.pair.drafters`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from specheads.pair.drafter_checks import check_drafter_files, check_state_fits, loaded_from, target_shape
from specheads.pair.drafters import default_layer_ids, speculators_models
from specheads.pair.drafters import load_drafter as load_speculators_drafter
from specheads.plumbing.errors import UsageError


def speculators_eagle3() -> Any:
    """speculators' eagle3 module (`Eagle3DraftModel`, `Eagle3SpeculatorConfig`), or a UsageError with the install line."""
    return speculators_models("eagle3")


def check_layer_ids(layer_ids: list[int], count: int, flag: str = "layer_ids") -> list[int]:
    """`layer_ids`, refused unless three distinct ids of a target with `count` layers (0..count: id i reads the
    stream entering layer i, id count the last layer's output)."""
    if len(layer_ids) != 3 or len(set(layer_ids)) != 3 or not all(0 <= i <= count for i in layer_ids):
        raise UsageError(f"{flag} {layer_ids} must be three distinct target layers in 0..{count}; the default is "
                         f"{default_layer_ids(count)}")
    return layer_ids


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


def load_drafter(folder: str | Path, target: torch.nn.Module, attention: str = "eager") -> torch.nn.Module:
    """The EAGLE-3 drafter saved in `folder` (speculators' format), completed with `target`'s weights, in eval mode,
    frozen, in the target's dtype and on its device (`specheads.pair.drafters.load_drafter`); a folder made for
    another target, or one it cannot draft with, is refused in one line first (`specheads.pair.drafter_checks`)."""
    shapes = check_drafter_files(folder, "eagle3", target_shape(target))

    def build(config: Any) -> torch.nn.Module:
        config.transformer_layer_config._attn_implementation = attention
        drafter = speculators_eagle3().Eagle3DraftModel(config)
        check_state_fits(drafter, shapes, folder)
        return drafter

    return loaded_from(load_speculators_drafter, folder, target, "eagle3", "Eagle3SpeculatorConfig", build)


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
