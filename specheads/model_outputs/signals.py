"""A model's logits, taken as its own forward takes them, and the training-free signals read from the draft's: one
definition for labelling and decoding."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError


@dataclass(frozen=True)
class LogitRule:
    """What a family's `forward` does around its LM head besides `lm_head(h)`, in this order: divide h by the config
    field `states_divided_by`, apply the head, multiply by `multiplied_by`, divide by `divided_by`, soft-cap to
    T·tanh(logits / T) with T = `softcap`, keep the first `vocab` columns (the rest pad the vocabulary). Each names a
    field of the model's config (of its text config where `text`); a field the config leaves unset skips its step."""

    states_divided_by: str | None = None
    multiplied_by: str | None = None
    divided_by: str | None = None
    softcap: str | None = "final_logit_softcapping"
    vocab: str | None = None
    text: bool = False


# Read from each family's ForCausalLM / ForConditionalGeneration forward in transformers 5.x (models/*/modeling_*.py);
# a family not named applies its LM head alone, soft-capped where its config sets final_logit_softcapping (the Gemma
# family, VaultGemma, NanoChat, Beam, Inkling2's text models).
LOGIT_RULES: dict[str, LogitRule] = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), LogitRule(multiplied_by="logit_scale")),
    "cohere_compass": LogitRule(multiplied_by="logit_scale", text=True),
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"),
                    LogitRule(divided_by="logits_scaling")),
    **dict.fromkeys(("granite4_vision", "granite_docling"), LogitRule(divided_by="logits_scaling", text=True)),
    "hyperclovax": LogitRule(multiplied_by="logits_scaling"),
    "hyperclovax_vision_v2": LogitRule(multiplied_by="logits_scaling", text=True),
    "falcon_h1": LogitRule(multiplied_by="lm_head_multiplier"),
    **dict.fromkeys(("muse_glimmer", "muse_spark"), LogitRule(multiplied_by="output_multiplier", text=True)),
    "minicpm3": LogitRule(states_divided_by="logits_scaling"),
    "inkling_text": LogitRule(states_divided_by="logits_mup_width_multiplier", vocab="unpadded_vocab_size"),
    "inkling_mm_model": LogitRule(states_divided_by="logits_mup_width_multiplier", vocab="unpadded_vocab_size",
                                  text=True),
    "recurrent_gemma": LogitRule(softcap="logits_soft_cap"),
    "xlstm": LogitRule(softcap="output_logit_soft_cap"),
    **dict.fromkeys(("gemma3n", "gemma4", "gemma4_unified", "paligemma", "mistral_large4", "inkling2", "inkling2_loop"),
                    LogitRule(text=True)),
}
HEADED_FAMILIES = frozenset((
    "bert", "big_bird", "camembert", "chameleon", "clvp", "csm", "data2vec-text", "electra", "ernie", "gemma4_assistant",
    "gemma4_unified_assistant", "megatron-bert", "modernbert-decoder", "musicgen", "musicgen_melody", "prophetnet",
    "reformer", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xmod",
))
"""Families whose forward turns the last hidden state into logits with more than their output embeddings (a
prediction head with its own layers, several heads, masked token ranges): refused rather than approximated."""


def logit_rule(model: Any) -> LogitRule:
    """How `model`'s forward takes its logits (`LOGIT_RULES`); a UsageError for a family `output_logits` cannot follow."""
    family = getattr(model.config, "model_type", None)
    if family in HEADED_FAMILIES:
        raise UsageError(f"{type(model).__name__} (model_type {family!r}) computes its logits with more than its output "
                         "embeddings, which specheads cannot reproduce exactly; use a decoder-only causal LM")
    return LOGIT_RULES.get(family, LogitRule())


def output_width(model: Any) -> int | None:
    """How many tokens `output_logits` gives `model` a probability for (its output layer's rows, less the padding rows
    its forward drops); None when it has no output layer to read. Refuses a family `output_logits` cannot follow, so
    calling it before any forward refuses such a model up front."""
    rule = logit_rule(model)
    layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(layer, "weight", None)
    if weight is None:
        return None
    rows = int(weight.shape[0])
    config = model.config.get_text_config() if rule.text else model.config
    kept = getattr(config, rule.vocab, None) if rule.vocab else None
    return rows if kept is None else min(rows, int(kept))


def output_logits(model: Any, states: torch.Tensor) -> torch.Tensor:
    """`model`'s logits for `states` (its decoder's last hidden states), taken as its own forward takes them: the LM
    head and the family's scaling, soft-capping and vocabulary trimming around it (`LOGIT_RULES`); float32, on the
    device of `states`."""
    rule = logit_rule(model)
    config = model.config.get_text_config() if rule.text else model.config

    def field(name: str | None) -> Any:
        return None if name is None else getattr(config, name, None)

    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    inputs = states
    if weight is not None and weight.device.type != "meta":  # an offloaded head's hook brings its weight and the input
        inputs = inputs.to(weight.device, weight.dtype if weight.is_floating_point() else inputs.dtype)
    if field(rule.states_divided_by) is not None:
        inputs = inputs / field(rule.states_divided_by)
    logits = head(inputs).float().to(states.device)
    if field(rule.multiplied_by) is not None:
        logits = logits * field(rule.multiplied_by)
    if field(rule.divided_by) is not None:
        logits = logits / field(rule.divided_by)
    if field(rule.softcap):
        logits = torch.tanh(logits / field(rule.softcap)) * field(rule.softcap)
    if field(rule.vocab) is not None:
        logits = logits[..., : field(rule.vocab)]
    return logits


def signal_log_probs(draft_logits: torch.Tensor, logq_all: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
    """The draft distribution the training-free signals read: q after the transform, or, since greedy q is
    one-hot, the untempered draft distribution under T = 0 (decoding computes them the same way)."""
    return draft_logits.float().log_softmax(-1) if transform.greedy else logq_all


def signal_statistics(logq_signal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy, top-1 probability, second-largest probability: 0 where the row has one token) per row of
    `signal_log_probs`' output, the two largest from one `topk` over the vocabulary; the top two give the top-2 margin
    (`top_two_margin`)."""
    q_signal = logq_signal.exp()
    entropy = torch.special.entr(q_signal).sum(-1)
    if logq_signal.shape[-1] < 2:
        return entropy, q_signal[..., 0], torch.zeros(logq_signal.shape[:-1], device=logq_signal.device)
    best = logq_signal.topk(2, dim=-1)
    # the top-1 taken from q itself, where the largest log q lies: the very value q's maximum is
    return entropy, q_signal.gather(-1, best.indices[..., :1]).squeeze(-1), best.values[..., 1].exp()


MAX_MARGIN = 40.0
"""The top-2 margin's clamp (vLLM's `_MAX_MARGIN`: a row with a single finite entry would emit an unbounded margin)."""


def top_two_margin(top1: float, top2: float) -> float:
    """The draft's top-2 logit margin, log max q − log of the second-largest q (the difference of the two largest
    logits after the sampling transform), in [0, 40]: how decisively the draft prefers its best token, a property of
    q known before the draw."""
    if top2 <= 0.0:
        return MAX_MARGIN
    return min(max(math.log(max(top1, top2)) - math.log(top2), 0.0), MAX_MARGIN)
