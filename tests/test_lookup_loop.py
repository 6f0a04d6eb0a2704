"""The serving loop (`specheads.train.lookup_loop`): after a block the head is fitted again on the logs of what it
served, and that head's rule serves the next block; a loop resumes and refuses another loop's folder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_vllm_proposer import copy_heavy

from specheads.decoding.free_replay import replay_speedups
from specheads.heads.lookup import TokenHeadModel
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError
from specheads.train.lookup_loop import Request, Serving, block_report, fixed_rules, run_loop, switching_queue
from specheads.train.lookup_refit import Recipe

RECIPE = Recipe(width=8, depth=0, lr=5e-2, max_epochs=3, batch_size=256)
SERVING = Serving(rule="lookup_plan:0.043", max_draft=8)


def eager_head(folder):
    """A head that trusts every proposed token (â near 1): its rule verifies whole proposals."""
    torch.manual_seed(0)
    model = TokenHeadModel("lookup_token_stop", width=8, depth=0)
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.fill_(8.0)
    return str(model.export(folder))


def queue() -> list[list[Request]]:
    prompts, responses = copy_heavy(3, 16)
    requests = [Request(f"p{i:02d}", "ab"[i % 2], p, r) for i, (p, r) in enumerate(zip(prompts, responses))]
    return switching_queue(requests, ["a", "b"], cycles=2)


def tensors(folder) -> dict[str, torch.Tensor]:
    return TokenHead.load(folder).tensors


def test_the_loop_retrains_on_what_it_served_and_the_new_heads_rule_serves_the_next_block(tmp_path):
    blocks, first = queue(), eager_head(tmp_path / "first")
    assert [block[0].family for block in blocks] == ["a", "b", "a", "b"] and all(len(b) == 4 for b in blocks)
    served = run_loop(blocks[:3], first, SERVING, RECIPE, tmp_path / "loop", warm=False)
    out = tmp_path / "loop"
    refitted = out / "block-0" / "head"
    assert served[0]["head"] == first and served[1]["head"] == str(refitted)
    # the head after block 0 learnt from block 0's log alone, and is not the head that served it
    assert TokenHead.load(refitted).config["training_data"]["path"] == str(out / "block-0" / "log.jsonl")
    assert any(not torch.equal(tensors(first)[name], value) for name, value in tensors(refitted).items())
    # block 1 is served by the refitted head's rule (exactly its replay), not by the first head's
    pairs = [(r.prompt, r.response) for r in blocks[1]]
    as_refitted = replay_speedups(pairs, [SERVING.rule], str(refitted), SERVING.max_draft)[SERVING.rule]
    as_first = replay_speedups(pairs, [SERVING.rule], first, SERVING.max_draft)[SERVING.rule]
    assert served[1]["speedups"] == pytest.approx(as_refitted, rel=1e-12)
    assert max(abs(a - b) for a, b in zip(as_refitted, as_first)) > 1e-3
    # the first block is the never-retrained head's, request for request
    assert served[0]["speedups"] == pytest.approx(fixed_rules(blocks, first, SERVING)["fixed"][:4], rel=1e-12)
    # the next head learns from every block served so far
    assert TokenHead.load(out / "block-1" / "head").config["training_data"]["path"] == ",".join(
        str(out / f"block-{i}" / "log.jsonl") for i in range(2))


def test_the_loop_resumes_from_its_folder_and_refuses_another_loops(tmp_path):
    blocks, first = queue(), eager_head(tmp_path / "first")
    served = run_loop(blocks[:2], first, SERVING, RECIPE, tmp_path / "loop", warm=True)
    # warm: the refitted head starts from the first head's weights and keeps its input statistics (a fresh one's are
    # the logs' means, not the first head's zeros)
    kept = tensors(tmp_path / "loop" / "block-0" / "head")
    assert torch.equal(kept["feature_mean"], tensors(first)["feature_mean"]) and not torch.equal(
        kept["out.bias"], tensors(first)["out.bias"])
    weights = (tmp_path / "loop" / "block-0" / "head" / "model.safetensors").stat().st_mtime_ns
    assert run_loop(blocks[:2], first, SERVING, RECIPE, tmp_path / "loop", warm=True) == served
    assert (tmp_path / "loop" / "block-0" / "head" / "model.safetensors").stat().st_mtime_ns == weights
    with pytest.raises(UsageError, match="another --out"):
        run_loop(blocks[:2], first, SERVING, RECIPE, tmp_path / "loop", warm=False)


def test_the_report_pairs_each_prompt_with_the_tables_and_pools_only_the_blocks_after_a_switch():
    blocks = queue()
    table = [1.0 + 0.1 * i for i in range(16)]
    loop = [[{"speedups": [2.0 * table[4 * b + i] for i in range(4)]} for b in range(4)]]
    loop[0][0]["speedups"] = [5.0, 5.0, 5.0, 5.0]  # block 0: the head before any retraining
    report = block_report(blocks, {"loop": loop[0]}, {"table": table, "fixed": [1.5 * t for t in table]},
                          resamples=50)
    assert [row["loop/table"]["speedup"] for row in report["blocks"][1:]] == pytest.approx([2.0] * 3)
    assert [row["loop/fixed"]["speedup"] for row in report["blocks"][1:]] == pytest.approx([2.0 / 1.5] * 3)
    assert report["blocks"][2]["fixed/table"]["speedup"] == pytest.approx(1.5)
    assert report["blocks"][0]["loop/table"]["speedup"] == pytest.approx(np.exp(np.mean(np.log(5.0 / np.array(
        table[:4])))))
    pooled = {row["family"]: row for row in report["families"]}
    assert pooled["all"]["blocks"] == [1, 2, 3] and pooled["all"]["loop/table"]["speedup"] == pytest.approx(2.0)
    assert pooled["a"]["blocks"] == [2] and pooled["a"]["table"]["prompts"] == 4
