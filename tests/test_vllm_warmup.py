"""vLLM's adaptive verification judged only out of its warm-up (issue 60): it drafts to the cap and checks every
candidate until its third refit, one every 100 rounds (vLLM's `REFIT_INTERVAL`, a constant there), so the serving
table records, for each live run, how many of its rounds came after the warm-up, and the report marks a run that
never left it, and every comparison with it, as judging nothing of its rule."""

import torch
from test_eval import LENGTH, PROMPT, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.costs import CostCurve, ServingCosts
from specheads.eval.report import serving_lines
from specheads.eval.serving import best_per_batch_size, decode_live, serving_table
from specheads.heads import ExpectedAcceptanceHead
from specheads.model_outputs.sampling import SamplingTransform

FLAT = ServingCosts(CostCurve((1, 256), (0.1, 0.12)), CostCurve((1, 256), (1.0, 1.1)))
"""Candidates checked almost for free: once warm, every planner drafts."""
REQUESTS = 200


def test_a_long_run_leaves_the_warm_up_and_a_short_one_is_reported_in_it():
    """200 requests of 3 tokens: one at a time they take over 300 rounds, past vLLM's warm-up (3 refits × 100
    rounds), and the record says by how many; 64 at a time they take a few dozen, all in it, and the report says a
    comparison with it there judges nothing."""
    target, draft = tiny_lm(seed=1), tiny_lm(seed=2)
    engine = RoundEngine(target, draft, SamplingTransform(1.0), stop_ids=[])
    torch.manual_seed(5)
    head = ExpectedAcceptanceHead(16, depth=1, extra_features=["entropy", "top1"]).eval()

    def live(policy, threshold, size, costs):
        return decode_live(engine, [PROMPT] * REQUESTS, list(range(REQUESTS)), make_policy(policy, threshold, max_draft=2),
                           LENGTH, size, costs, head if policy == "goodput" else None)

    rows = serving_table([], {}, [1, 64], {"flat": lambda size: FLAT}, live, {"goodput": 2.0, "vllm_adaptive": 2.0},
                         resamples=0)
    vllm = {row["batch_size"]: row for row in rows if row["policy"] == "vllm_adaptive"}
    long, short = vllm[1]["warmup"], vllm[64]["warmup"]
    assert long["rounds"] > 300 and long["past_warmup"] == long["rounds"] - 300
    assert 0 < short["rounds"] < 300 and short["past_warmup"] == 0
    goodput = {row["batch_size"]: row for row in rows if row["policy"] == "goodput"}
    assert "warmup" not in goodput[1]  # a trained head's planner reads its signal from the first round
    assert goodput[64]["vs_live"]["vllm_adaptive"]["warmup"] == short

    serving = {"batch_sizes": [1, 64], "rows": rows, "views": ["flat"], "best": best_per_batch_size(rows),
               "cost_curves": {"flat": {"source": "given"}}, "budget": {}, "scaled_draft_ratio": 0.2}
    report = "\n".join(serving_lines(serving, "##", "serving.png"))
    assert (f"vllm_adaptive's rounds past its warm-up (before it: drafting to the cap, every candidate checked): "
            f"B = 1: {long['past_warmup']} of {long['rounds']}, B = 64: 0 of {short['rounds']}. At B = 64 it never left "
            "its warm-up: a comparison with it there is one with constant K_max") in report
    assert f"[warm-up: 0 of {short['rounds']} rounds past it]" in report
    assert f"B = 64: vllm_adaptive {goodput[64]['vs_live']['vllm_adaptive']['change']:+.1%} (not judged: in its warm-up all" in report
    assert f"(past its warm-up in {long['past_warmup']} of {long['rounds']} rounds)" in report
