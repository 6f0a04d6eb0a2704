"""The decoding's sampling transform (temperature, top-k, top-p) and seeded draws from it.

Both p (target) and q (draft) are labelled *after* this transform, so the labels describe the
decoding they will be used in. Temperature 0 means greedy: the transformed distribution is the
one-hot of the argmax.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from specheads.plumbing.errors import UsageError


@dataclass(frozen=True)
class SamplingTransform:
    """Temperature, then top-k, then top-p, renormalised (the order transformers applies them)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UsageError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when the decoding is greedy (temperature 0)."""
        return self.temperature == 0

    def as_dict(self) -> dict:
        """Plain dict for manifests and configs."""
        return asdict(self)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 log-probabilities over the last axis after the transform; -inf outside the support."""
        logits = logits.float()
        if self.greedy:
            out = torch.full_like(logits, -math.inf)
            return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth_largest = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth_largest, -math.inf)
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop_sorted = mass_before >= self.top_p  # keeps the smallest prefix whose mass reaches top_p
            drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, -math.inf)
        return logits.log_softmax(-1)


def draw_from_log_probs(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of `log_probs` [n, V] with `uniforms` [n] in (0, 1].

    The uniforms come from a per-row CPU generator, so a draw does not depend on the device, on the
    batch the row sits in, or on how many processes share the work.
    """
    probs = log_probs.exp()
    cdf = probs.cumsum(-1)
    targets = (uniforms.to(cdf.device, cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    # the first index whose cdf reaches the target always has positive probability
    return torch.searchsorted(cdf, targets).squeeze(-1).clamp_(max=log_probs.shape[-1] - 1)


def row_generator(seed: int) -> torch.Generator:
    """A CPU generator for one row's random stream."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def uniforms(generator: torch.Generator, n: int) -> torch.Tensor:
    """`n` uniforms in (0, 1] from `generator` (never exactly 0, so inverse-CDF draws stay in the support)."""
    return 1.0 - torch.rand(n, generator=generator, dtype=torch.float64)
