"""The sampling transform against a per-token brute force, and the seeded inverse-CDF draw."""

import math

import pytest
import torch

from specheads.model_outputs.sampling import SamplingTransform, draw_from_log_probs, row_generator, uniforms


def brute_force_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Temperature, top-k (ties kept), top-p (smallest prefix reaching top_p), renormalised; T=0 is one-hot."""
    n = len(logits)
    if temperature == 0:
        best = max(range(n), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(n)]
    scaled = [x / temperature for x in logits]
    keep = [True] * n
    if 0 < top_k < n:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = [x >= kth for x in scaled]
    if top_p < 1:
        z = sum(math.exp(x) for x, k in zip(scaled, keep) if k)
        order = sorted((i for i in range(n) if keep[i]), key=lambda i: -scaled[i])
        mass = 0.0
        for i in order:
            if mass >= top_p:
                keep[i] = False
            mass += math.exp(scaled[i]) / z
    z = sum(math.exp(x) for x, k in zip(scaled, keep) if k)
    return [math.exp(x) / z if k else 0.0 for x, k in zip(scaled, keep)]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                     (1.0, 0, 0.8), (0.6, 8, 0.9), (0.0, 0, 1.0)])
def test_transform_matches_brute_force(temperature, top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(6, 17) * 2
    log_probs = SamplingTransform(temperature, top_k, top_p).log_probs(logits)
    for row in range(logits.shape[0]):
        expected = torch.tensor(brute_force_probs(logits[row].tolist(), temperature, top_k, top_p))
        assert torch.allclose(log_probs[row].exp(), expected, atol=1e-5)
        assert math.isclose(float(log_probs[row].exp().sum()), 1.0, rel_tol=1e-5)


def test_bad_transform_values_are_refused():
    from specheads.plumbing.errors import UsageError

    for kwargs in ({"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(UsageError):
            SamplingTransform(**kwargs)


def test_draws_follow_the_distribution_and_stay_in_support():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    log_probs = probs.log().expand(20000, -1)
    draws = draw_from_log_probs(log_probs, uniforms(row_generator(7), 20000))
    counts = torch.bincount(draws, minlength=6).double() / 20000
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts, probs.double(), atol=0.015)


def test_draws_are_reproducible_per_seed():
    log_probs = torch.randn(50, 30).log_softmax(-1)
    first = draw_from_log_probs(log_probs, uniforms(row_generator(3), 50))
    again = draw_from_log_probs(log_probs, uniforms(row_generator(3), 50))
    other = draw_from_log_probs(log_probs, uniforms(row_generator(4), 50))
    assert torch.equal(first, again) and not torch.equal(first, other)
