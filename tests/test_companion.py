"""SV's companion predictor (eval.companion): its signals equal their definitions on a tiny pair, and its equal-count
bins predict each cell's mean acceptance of the profiling set."""

import datasets
import numpy as np
import pytest
import torch
from test_eval import tiny_lm

from specheads.eval.companion import companion_signals, equal_count_edges, profile
from specheads.sampling import SamplingTransform


def test_signals_are_the_agreement_and_the_companion_acceptance_of_the_drafted_token():
    draft, companion = tiny_lm(seed=5, vocab=12), tiny_lm(seed=6, vocab=12)
    transform = SamplingTransform(0.8)
    rows = datasets.Dataset.from_dict({"prompt_ids": [[1, 2], [3, 4, 5, 6]], "target_ids": [[7, 8, 9], [1]],
                                       "draft_ids": [[7, 0, 9], [11]]})
    signals = companion_signals(draft, companion, transform, rows, batch=2)  # padded together
    for row, (s, a) in zip(rows, signals):
        ids = torch.tensor([row["prompt_ids"] + row["target_ids"]])
        q = transform.log_probs(draft(ids).logits[0]).exp()
        c = transform.log_probs(companion(ids).logits[0]).exp()
        for j, token in enumerate(row["draft_ids"]):
            step = len(row["prompt_ids"]) - 1 + j  # conditioned on the prompt and the target's tokens before j
            assert s[j] == pytest.approx(float(torch.minimum(q[step], c[step]).sum()), abs=1e-5)
            assert a[j] == pytest.approx(min(1.0, float(c[step, token] / q[step, token])), abs=1e-5)


def test_equal_count_bins_predict_each_cells_mean_acceptance():
    rng = np.random.default_rng(0)
    s, a = rng.uniform(size=4000), rng.uniform(size=4000)
    accept = np.clip(0.2 + 0.5 * s + 0.3 * a + rng.normal(0, 0.05, 4000), 0, 1)
    table = profile(s, a, accept, s_bins=10, a_bins=5)
    assert len(table.s_edges) == 9 and len(table.a_edges) == 4
    counts = np.histogram(s, bins=[0, *table.s_edges, 1])[0]
    assert counts.min() > 0.9 * 400  # equal-count bins
    inside = (s < table.s_edges[0]) & (a < table.a_edges[0])
    assert table.predict(np.array([0.0]), np.array([0.0]))[0] == pytest.approx(accept[inside].mean())
    assert np.corrcoef(table.predict(s, a), accept)[0, 1] > 0.9
    edges = equal_count_edges(np.array([0.5] * 50 + [0.9] * 50), 10)
    assert len(edges) == 3  # 9 quantiles of two tied values: 0.5, the midpoint, 0.9
