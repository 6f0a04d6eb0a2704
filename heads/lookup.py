"""The token-only heads of free drafts (prompt lookup, suffix) as trainable modules: `TokenHeadModel` holds the
weights under the names the runtime reads and computes its logits with the runtime's own function
(`specheads.lookup.token_head.head_logits`), so a trained head scores alike in training, eval, our decoder and vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specheads.lookup.features import FEATURE_NAMES
from specheads.lookup.token_head import CONFIG, FORMAT, HEAD_TYPES, WEIGHTS, TokenHead, head_logits
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import atomic_path, write_json_atomic

MIN_STD = 1e-3
"""Floor on an input's std, so that a constant input standardises to finite values."""


class TokenHeadModel(nn.Module):
    """A token-only head: standardised token features (and optionally the target's state), an input layer of `width`,
    `depth` residual SiLU blocks (zero-initialised: a fresh head is its input and output layers), one logit."""

    def __init__(self, head_type: str, width: int = 64, depth: int = 2, target_state_size: int = 0,
                 draft_kind: str = "lookup") -> None:
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise UsageError(f"unknown token head type {head_type!r}; known: {', '.join(HEAD_TYPES)}")
        if width < 1 or depth < 0 or target_state_size < 0:
            raise UsageError(f"a token head needs width >= 1, depth >= 0 and target_state_size >= 0, got {width}, "
                             f"{depth}, {target_state_size}")
        self.head_type, self.width, self.depth = head_type, width, depth
        self.target_state_size, self.draft_kind = target_state_size, draft_kind
        inputs = len(FEATURE_NAMES)
        self.register_buffer("feature_mean", torch.zeros(inputs))
        self.register_buffer("feature_std", torch.ones(inputs))
        if target_state_size:
            self.register_buffer("target_mean", torch.zeros(target_state_size))
            self.register_buffer("target_std", torch.ones(target_state_size))
        self.input = nn.Linear(inputs + target_state_size, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.out = nn.Linear(width, 1)

    @property
    def purpose(self) -> str:
        """`stop` (the conditional â_k) or `expect` (the survival s_k)."""
        return HEAD_TYPES[self.head_type]

    def tensors(self) -> dict[str, Tensor]:
        """Every weight and statistic by the name the runtime reads."""
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}

    def forward(self, features: Tensor, target_state: Tensor | None = None) -> Tensor:
        """Logits [...] of token features [..., F] (and the target's state [..., h]): `head_logits`."""
        return head_logits(self.tensors(), features, target_state)

    @torch.no_grad()
    def set_statistics(self, features: Tensor, target_state: Tensor | None = None) -> None:
        """Standardise the inputs with their mean and std over training rows [N, F] ([N, h])."""
        self.feature_mean.copy_(features.double().mean(0).float())
        self.feature_std.copy_(features.double().std(0).float().nan_to_num(1.0).clamp_min(MIN_STD))
        if self.target_state_size and target_state is not None:
            self.target_mean.copy_(target_state.double().mean(0).float())
            self.target_std.copy_(target_state.double().std(0).float().nan_to_num(1.0).clamp_min(MIN_STD))

    def config(self, **extra: Any) -> dict[str, Any]:
        """What config.json records: the runtime's format, the head's kind, inputs and shape, plus `extra` (what it
        was trained on)."""
        return {"format": FORMAT, "head_type": self.head_type, "purpose": self.purpose, "inputs": list(FEATURE_NAMES),
                "width": self.width, "depth": self.depth, "target_state_size": self.target_state_size,
                "draft_kind": self.draft_kind, **extra}

    def export(self, folder: str | Path, **extra: Any) -> Path:
        """Write the head folder the runtime loads (`TokenHead.load`): model.safetensors and config.json, each
        atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / WEIGHTS) as temporary:
            save_file({name: value.detach().float().contiguous().cpu() for name, value in self.tensors().items()},
                      str(temporary))
        write_json_atomic(folder / CONFIG, self.config(**extra))
        return folder

    @classmethod
    def from_runtime(cls, head: TokenHead) -> TokenHeadModel:
        """The module of a loaded runtime head (same weights)."""
        config = head.config
        model = cls(config["head_type"], config["width"], config["depth"], config.get("target_state_size", 0),
                    config.get("draft_kind", "lookup"))
        model.load_state_dict(head.tensors)
        return model
