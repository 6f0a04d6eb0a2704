"""Which draft hidden state a head reads (`state_layer`), taken from one decoder forward.

`None` (the default, docs/data.md's `features`) is the last layer's state after the final norm. An integer L
is the residual stream after the first L decoder layers, before any norm (`hidden_states[L]` in
transformers' terms). Gen stores it as `features`, online training computes it, and the decoding loop
hands the same state to the head, so one function serves all three.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from specheads.plumbing.errors import UsageError


def describe_state(state_layer: int | None) -> str:
    """`state_layer` in words, for messages and cards."""
    return "of the last layer (after the final norm)" if state_layer is None else f"after draft layer {state_layer}"


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder's list of layers (a UsageError for a model without one)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UsageError(f"cannot read an inner layer of {type(model).__name__}: its decoder has no `layers` list; "
                         "use state_layer null (the last layer)")
    return layers


def check_state_layer(model: Any, state_layer: int | None) -> int | None:
    """`state_layer` if `model` has that many decoder layers; a UsageError naming the valid range otherwise."""
    if state_layer is None:
        return None
    count = len(decoder_layers(model))
    if isinstance(state_layer, bool) or not isinstance(state_layer, int) or not 1 <= state_layer <= count:
        raise UsageError(f"state_layer {state_layer!r} is out of range for a draft with {count} decoder layers; "
                         f"give 1..{count} (the state after that many layers) or null (the last layer after the final norm)")
    return state_layer


def cache_argument(model: Any) -> str:
    """The name the decoder's forward takes its KV cache by: `cache` from transformers 5.2x on (`past_key_values`
    still works there but warns, and goes in 5.40), `past_key_values` before."""
    parameters = inspect.signature(type(model.get_decoder()).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a decoder forward returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def decoder_forward(model: Any, state_layer: int | None, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """(the decoder's output, the states at `state_layer` [B, L, h]) from one forward with `inputs`."""
    decoder = model.get_decoder()
    if state_layer is None:
        output = decoder(**inputs)
        return output, output.last_hidden_state
    captured: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)

    hook = decoder_layers(model)[state_layer - 1].register_forward_hook(keep)
    try:
        output = decoder(**inputs)
    finally:
        hook.remove()
    return output, captured[0]


def decoder_states(model: Any, sequences: list[list[int]], pad_id: int, device: torch.device,
                   state_layer: int | None = None) -> torch.Tensor:
    """The decoder's states for right-padded `sequences`: [B, L, h] on `device` (wherever a split model's last layer
    ran); the last layer's (after the final norm) unless `state_layer` names an inner one (`specheads.model_outputs.states`)."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask[row, : len(sequence)] = 1
    return decoder_forward(model, state_layer, input_ids=input_ids.to(device),
                           attention_mask=attention_mask.to(device), use_cache=False)[1].to(device)


def mixed_states(draft: Any, prompts: list[list[int]], mixed: list[list[int]], pad_id: int,
                 device: torch.device, state_layer: int | None = None) -> list[torch.Tensor]:
    """Draft states (at `state_layer`) on prompt + mixed tokens, at the prompt's last position and every response
    position: one [len(mixed) + 1, h] tensor per row, on `device` (what `features` stores, and what online
    training computes)."""
    states = decoder_states(draft, [list(p) + list(m) for p, m in zip(prompts, mixed)], pad_id, device, state_layer)
    return [states[row, len(p) - 1 : len(p) + len(m)] for row, (p, m) in enumerate(zip(prompts, mixed))]
