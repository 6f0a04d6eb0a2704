"""DSpark drafters in speculators' format (`speculators_model_type: dspark`, the `eagle3` extra): build one for a
target, load or save its folder (`specheads.pair.drafters` holds what it shares with EAGLE-3).

A DSpark drafter (speculators' `DSparkDraftModel`, DFlash's backbone plus two heads) drafts a block per forward. Its
context is the target's streams at a few layers (`aux_hidden_state_layer_ids`), projected by `fc` and normed, for every
position the target has read; each of its layers attends from the block's queries to keys and values of that context
and of the block itself (non-causal within the block). The block is the anchor token, the last token of the prefix,
followed by `block_size − 1` mask tokens (`mask_token_id`), at the positions after the context. Slot s's output,
normed and through the LM head, is the base logits of one drafted position: with `sample_from_anchor` (DSpark's
default) slot s predicts the token after position anchor + s, so a block drafts `block_size` candidates; without it slot
0 is unused and a block drafts `block_size − 1`. The Markov head adds a logit bias from the token before the candidate
(`markov_w2(markov_w1[previous])`; `gated` gates it with the slot's state, `rnn` runs a recurrent state over the
block), so candidate k's q depends on the candidates drawn before it, and no more. The confidence head,
sigmoid(`confidence_head.proj`([slot state after the final norm ; markov_w1[previous]])), is the drafter's own
prediction of the candidate's acceptance, trained jointly by BCE on Σ min(p, q) (`specheads.train.drafter`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specheads.pair.drafter_checks import check_drafter_files, check_state_fits, loaded_from, target_shape
from specheads.pair.drafters import default_layer_ids, speculators_models
from specheads.pair.drafters import load_drafter as load_speculators_drafter
from specheads.plumbing.errors import UsageError

MARKOV_HEADS = ("vanilla", "gated", "rnn")
"""The Markov heads the decoding core drafts with: all of speculators 0.9.0's."""


def speculators_dspark() -> Any:
    """speculators' dspark module (`DSparkDraftModel`, `DSparkSpeculatorConfig`), or a UsageError with the install line."""
    return speculators_models("dspark")


def check_layer_ids(layer_ids: list[int], count: int, flag: str = "layer_ids") -> list[int]:
    """`layer_ids`, refused unless one or more distinct ids of a target with `count` layers (0..count: id i reads the
    stream entering layer i, id count the last layer's output)."""
    if not layer_ids or len(set(layer_ids)) != len(layer_ids) or not all(0 <= i <= count for i in layer_ids):
        raise UsageError(f"{flag} {layer_ids} must be distinct target layers in 0..{count}; the default is "
                         f"{default_layer_ids(count)}")
    return layer_ids


def block_candidates(config: Any) -> int:
    """The candidates one block drafts: `block_size` with `sample_from_anchor`, one fewer without."""
    return config.block_size if config.sample_from_anchor else config.block_size - 1


def layer_config(target_config: Any, num_layers: int, attention: str = "eager") -> Any:
    """The drafter's decoder layers' config: Qwen3 layers shaped as the target's (speculators' DFlash family default),
    full attention in every layer."""
    from transformers import Qwen3Config

    heads = target_config.num_attention_heads
    config = Qwen3Config(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        hidden_act=getattr(target_config, "hidden_act", "silu"), max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6), rope_parameters=dict(target_config.rope_parameters),
        tie_word_embeddings=False, layer_types=["full_attention"] * num_layers,
        pad_token_id=getattr(target_config, "pad_token_id", None))
    config._attn_implementation = attention
    return config


def build_drafter(target_config: Any, layer_ids: list[int], draft_vocab_size: int, verifier: str, mask_token_id: int,
                  num_layers: int = 1, block_size: int = 8, markov_rank: int = 256, markov_head_type: str = "vanilla",
                  sample_from_anchor: bool = True, confidence_head: bool = True, attention: str = "eager") -> torch.nn.Module:
    """A freshly initialised `DSparkDraftModel` for a target with config `target_config`: `num_layers` Qwen3 layers
    shaped as the target's, reading `layer_ids`, drafting blocks of `block_size` with mask token `mask_token_id`, over
    `draft_vocab_size` tokens, a Markov head of `markov_rank` (0: none) and `markov_head_type`, and a confidence head
    on [state ; Markov embedding] where asked; `verifier` is the target's name as the folder records it. Its
    embedding, LM head and vocabulary maps are empty until `specheads.pair.drafters.fill_from_target`."""
    dspark = speculators_dspark()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    check_target(target_config)
    check_layer_ids(layer_ids, target_config.num_hidden_layers)
    check_settings(block_size, mask_token_id, target_config.vocab_size, markov_head_type, sample_from_anchor)
    candidates = block_size if sample_from_anchor else block_size - 1
    config = dspark.DSparkSpeculatorConfig(
        transformer_layer_config=layer_config(target_config, num_layers, attention), draft_vocab_size=draft_vocab_size,
        block_size=block_size, aux_hidden_state_layer_ids=layer_ids, mask_token_id=mask_token_id,
        sample_from_anchor=sample_from_anchor, markov_rank=markov_rank, markov_head_type=markov_head_type,
        enable_confidence_head=confidence_head, confidence_head_with_markov=confidence_head and markov_rank > 0,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=candidates)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(target_config.architectures or []))))
    return new_drafter(config)


def check_target(target_config: Any) -> None:
    """Refuse a target whose final norm applies x·(1 + w) (Gemma-style): `new_drafter` makes the plain norm, which only
    training reads."""
    from speculators.models.utils import GEMMA_STYLE_FINAL_NORM_MODEL_TYPES

    if getattr(target_config, "model_type", None) in GEMMA_STYLE_FINAL_NORM_MODEL_TYPES:
        raise UsageError(f"a {target_config.model_type} target's final norm applies x·(1 + w), which this recipe's "
                         "training targets do not reproduce yet; train its DSpark drafter with speculators' own trainer")


def new_drafter(config: Any) -> torch.nn.Module:
    """speculators' `DSparkDraftModel(config)`, made without looking the verifier's config up by its name: speculators
    would ask the Hub for it only to choose the gain convention of `verifier_norm` (x·w, or x·(1 + w) for Gemma-style
    targets), which only training reads; the plain one is made, and `build_drafter` refuses a Gemma-style target."""
    verifier = config.speculators_config.verifier
    name, verifier.name_or_path = verifier.name_or_path, None
    try:
        return speculators_dspark().DSparkDraftModel(config)
    finally:
        verifier.name_or_path = name


def check_settings(block_size: int, mask_token_id: int | None, vocabulary: int, markov_head_type: str,
                   sample_from_anchor: bool) -> None:
    """Refuse a block the decoding core cannot draft: no candidate in it, no mask token in the target's vocabulary, or
    a Markov head it does not know."""
    if block_size < (1 if sample_from_anchor else 2):
        raise UsageError(f"block_size {block_size} drafts no candidate{'' if sample_from_anchor else ' without sample_from_anchor'}"
                         f"; give at least {1 if sample_from_anchor else 2}")
    if mask_token_id is None or not 0 <= mask_token_id < vocabulary:
        raise UsageError(f"mask_token_id {mask_token_id} is not a token of the target's vocabulary (0..{vocabulary - 1}); "
                         "give the id the drafter was trained with")
    if markov_head_type not in MARKOV_HEADS:
        raise UsageError(f"markov_head_type {markov_head_type!r} is not one the decoding core drafts with "
                         f"({', '.join(MARKOV_HEADS)})")


def check_drafter(config: Any, folder: Path) -> None:
    """Refuse, before the weights load, a DSpark drafter the decoding core cannot draft with exactly as it was trained:
    sliding-window layers (their mask within a block is not the full one), or a block it cannot draft (`check_settings`)."""
    layers = config.transformer_layer_config
    types = getattr(layers, "layer_types", None) or []
    if any(kind != "full_attention" for kind in types):
        raise UsageError(f"{folder} has sliding-window layers ({types}); the decoding core drafts with full-attention "
                         "DSpark layers only")
    try:
        check_settings(config.block_size, config.mask_token_id, layers.vocab_size, config.markov_head_type,
                       config.sample_from_anchor)
    except UsageError as error:
        raise UsageError(f"{folder}/config.json: {error}") from None


def load_drafter(folder: str | Path, target: torch.nn.Module, attention: str = "eager") -> torch.nn.Module:
    """The DSpark drafter saved in `folder` (speculators' format), completed with `target`'s weights, in eval mode,
    frozen, in the target's dtype and on its device (`specheads.pair.drafters.load_drafter`); one made for another
    target (`specheads.pair.drafter_checks`) or that it cannot draft with (`check_drafter`) is refused in one line."""
    shapes = check_drafter_files(folder, "dspark", target_shape(target))

    def build(config: Any) -> torch.nn.Module:
        check_drafter(config, Path(folder))
        config.transformer_layer_config._attn_implementation = attention
        drafter = new_drafter(config)
        check_state_fits(drafter, shapes, folder)
        return drafter

    return loaded_from(load_speculators_drafter, folder, target, "dspark", "DSparkSpeculatorConfig", build)
