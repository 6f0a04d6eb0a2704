"""The token-only head's runtime: load an exported head folder (model.safetensors + config.json) and score a free
draft's proposal, per proposed position, with its conditional acceptance estimate â_k (the chance x_k is accepted once
x_1..x_{k-1} were).

The forward is one function, `head_logits`: the training module (`specheads.heads.lookup.TokenHeadModel`) calls it on
its own parameters, so training, evaluation, our decoder and vLLM's proposer compute the same floats.

Two kinds of head (config.json's `head_type`):
- `lookup_token_stop` predicts â_k directly (trained on the conditional label, weighted by the chance of reaching k);
- `lookup_token_expected` predicts the survival s_k = P(x_1..x_k all accepted) (trained at every position on the
  product of the labels); â_k = s_k / s_{k-1} of its running minimum.
A head `with the target's state` (target_state_size > 0) also reads the target's hidden state at the last verified
position (the verify computed it).

This module imports only the standard library, numpy, torch, safetensors and specheads' dependency-free errors: vLLM's
environment imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specheads.lookup.features import FEATURE_NAMES, ProposalLike, token_features
from specheads.plumbing.errors import UsageError

FORMAT = "specheads-lookup-head"
STOP, EXPECTED = "lookup_token_stop", "lookup_token_expected"
HEAD_TYPES = {STOP: "stop", EXPECTED: "expect"}
"""The token-only head types and their purpose (stop: the conditional â_k; expect: the survival s_k)."""
DRAFT_KINDS = ("lookup", "suffix")
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def head_logits(tensors: Mapping[str, Tensor], features: Tensor, target_state: Tensor | None = None) -> Tensor:
    """Logits [...] of features [..., F] (and the target's state [..., h] for a head that reads it): standardise,
    SiLU(input layer), residual blocks x <- x + SiLU(W_d x + b_d), one output logit. `tensors` holds the head's weights
    by their saved names (`feature_mean`, `feature_std`, [`target_mean`, `target_std`], `input.*`, `blocks.d.*`,
    `out.*`)."""
    x = (features - tensors["feature_mean"]) / tensors["feature_std"]
    if "target_mean" in tensors:
        if target_state is None:
            raise UsageError("this token head reads the target's state at the last verified position; pass target_state")
        x = torch.cat([x, (target_state.to(x.dtype) - tensors["target_mean"]) / tensors["target_std"]], dim=-1)
    h = torch.nn.functional.silu(torch.nn.functional.linear(x, tensors["input.weight"], tensors["input.bias"]))
    depth = 0
    while f"blocks.{depth}.weight" in tensors:
        h = h + torch.nn.functional.silu(torch.nn.functional.linear(h, tensors[f"blocks.{depth}.weight"],
                                                                    tensors[f"blocks.{depth}.bias"]))
        depth += 1
    return torch.nn.functional.linear(h, tensors["out.weight"], tensors["out.bias"]).squeeze(-1)


def conditional_estimates(probabilities: np.ndarray, head_type: str) -> np.ndarray:
    """Per-position conditional acceptance â_k from a head's sigmoid outputs over one proposal: the stop head's as
    they are; the expected head's survival s_k made non-increasing, then s_k / s_{k-1}."""
    if head_type == STOP:
        return probabilities
    survival = np.minimum.accumulate(np.clip(probabilities, 0.0, 1.0))
    before = np.concatenate([[1.0], survival[:-1]])
    return np.divide(survival, before, out=np.zeros_like(survival), where=before > 0)


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors a head of `config` holds, by name, with their shapes."""
    inputs, width, state = len(config["inputs"]), int(config["width"]), int(config.get("target_state_size", 0))
    shapes: dict[str, tuple[int, ...]] = {"feature_mean": (inputs,), "feature_std": (inputs,),
                                          "input.weight": (width, inputs + state), "input.bias": (width,),
                                          "out.weight": (1, width), "out.bias": (1,)}
    if state:
        shapes |= {"target_mean": (state,), "target_std": (state,)}
    for block in range(int(config["depth"])):
        shapes |= {f"blocks.{block}.weight": (width, width), f"blocks.{block}.bias": (width,)}
    return shapes


def read_config(folder: Path, draft_kind: str | None) -> dict[str, Any]:
    """The head folder's config.json, refused in one line unless it is a token head for these inputs (and for
    `draft_kind` when given)."""
    path = folder / CONFIG
    if not path.is_file() or not (folder / WEIGHTS).is_file():
        raise UsageError(f"{folder} is not a token head folder ({CONFIG} and {WEIGHTS}); give the folder "
                         "`specheads train lookup fit` exported")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path} is not valid JSON ({error}); export the head again") from None
    kind = config.get("head_type") if isinstance(config, dict) else None
    if not isinstance(config, dict) or config.get("format") != FORMAT or kind not in HEAD_TYPES:
        raise UsageError(f"{folder} holds a {kind!r} head, not a token-only head of a free draft ({', '.join(HEAD_TYPES)}); "
                         "give a head trained on lookup labels (`specheads gen --drafter.kind lookup`)")
    if list(config.get("inputs", [])) != list(FEATURE_NAMES):
        raise UsageError(f"{folder} reads the inputs {config.get('inputs')}, not this version's token features "
                         f"{list(FEATURE_NAMES)}; retrain it on labels from this version")
    trained_on = config.get("draft_kind")
    if draft_kind is not None and trained_on != draft_kind:
        raise UsageError(f"{folder} was trained on {trained_on!r} drafts, not {draft_kind!r}; give a head trained on "
                         f"{draft_kind} labels or draft by {trained_on}")
    return config


class TokenHead:
    """An exported token-only head, ready to score proposals (CPU, float32, no gradients)."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, Tensor], folder: Path | None = None) -> None:
        self.config, self.tensors, self.folder = config, tensors, folder

    @property
    def head_type(self) -> str:
        """`lookup_token_stop` or `lookup_token_expected`."""
        return self.config["head_type"]

    @property
    def target_state_size(self) -> int:
        """The width of the target state it reads (0: token ids only)."""
        return int(self.config.get("target_state_size", 0))

    @classmethod
    def load(cls, folder: str | Path, draft_kind: str | None = None, target_state_size: int | None = None) -> TokenHead:
        """The head exported in `folder`; refused in one line when it is not a token head, reads other inputs, was
        trained on another draft kind than `draft_kind`, reads a target state of another width than
        `target_state_size` (when given), or its weights do not fit its config."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config = read_config(folder, draft_kind)
        reads = int(config.get("target_state_size", 0))
        if target_state_size is not None and reads != target_state_size:
            has = f"reads a target state of width {reads}" if reads else "reads token ids only"
            raise UsageError(f"{folder} {has}, not {target_state_size or 'none'}; give a head trained for this "
                             f"{'target' if target_state_size else 'engine (token-only)'}")
        try:
            tensors = {name: value.float() for name, value in load_file(str(folder / WEIGHTS)).items()}
        except Exception as error:  # safetensors raises its own types for a damaged file
            raise UsageError(f"{folder / WEIGHTS} is not a readable safetensors file ({error}); export the head again") from None
        shapes = {name: tuple(value.shape) for name, value in tensors.items()}
        if shapes != expected_shapes(config):
            raise UsageError(f"{folder / WEIGHTS} does not hold the tensors its {CONFIG} describes; export the head again")
        return cls(config, tensors, folder)

    @torch.no_grad()
    def probabilities(self, features: np.ndarray, target_state: np.ndarray | None = None) -> np.ndarray:
        """The head's sigmoid outputs [n] of features [n, F] (â_k for a stop head, s_k for an expected head)."""
        state = None if target_state is None else torch.as_tensor(target_state, dtype=torch.float32)
        logits = head_logits(self.tensors, torch.as_tensor(features, dtype=torch.float32), state)
        return torch.sigmoid(logits).numpy().astype(np.float64)

    def estimates(self, proposal: ProposalLike | Any, target_state: np.ndarray | None = None) -> list[float]:
        """The conditional acceptance estimate â_k of every proposed token (the round engine's rule hook); a head
        that reads the target's state takes it at the last verified position ([h])."""
        if not proposal.tokens:
            return []
        features = token_features(proposal)
        state = None if target_state is None else np.broadcast_to(target_state, (len(features), len(target_state)))
        return conditional_estimates(self.probabilities(features, state), self.head_type).tolist()
