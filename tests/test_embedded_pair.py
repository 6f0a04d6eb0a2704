"""Integration tier: the real embedded SmolLM2 pair (converted once to a local safetensors cache)."""

import time

import numpy as np
import pytest
import torch

from specheads.cli import main
from specheads.dataset.store import load_labelled, read_manifest
from specheads.pair.embedded import embedded_folder
from specheads.pair.models import ModelSpec, load_pair, load_tokenizers

pytestmark = pytest.mark.integration


def test_embedded_model_is_cached_and_loads_fast():
    folder = embedded_folder()
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    start = time.perf_counter()
    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(skip_layers=[20, 21]))
    assert time.perf_counter() - start < 20
    assert pair.target.config.num_hidden_layers == 30 and pair.draft.config.num_hidden_layers == 28
    assert pair.draft.model.layers[20].self_attn.layer_idx == 20  # renumbered, own module
    assert pair.draft.model.layers[20] is not pair.target.model.layers[20]
    assert pair.draft.model.layers[20].self_attn.q_proj.weight is pair.target.model.layers[22].self_attn.q_proj.weight
    # the shipped head, trained for the target minus layers 20-21, refuses the target minus 10-11 (as many layers)
    from specheads.heads import load_head
    from specheads.integrations.transformers import check_trained_for
    from specheads.pair.models import without_layers
    from specheads.plumbing.errors import UsageError

    head, _ = load_head("smollm2-ontime")
    check_trained_for(head, pair.draft, pair.target)
    with pytest.raises(UsageError, match=r"it skips the target's layers \[10, 11\], the head was trained for a draft "
                                         r"skipping \[20, 21\]"):
        check_trained_for(head, without_layers(pair.target, [10, 11]), pair.target)


def test_gen_on_the_embedded_pair(tmp_path):
    out = tmp_path / "gen"
    code = main(["gen", "--config", "configs/gen/smollm2-demo.yaml", "--num-prompts", "5", "--samples-per-prompt", "2",
                 "--max-new-tokens", "24", "--out", str(out), "--progress", "false"])
    assert code == 0
    manifest = read_manifest(out)
    rows = load_labelled(out)
    assert manifest["complete"] and len(rows) == 10
    accept = np.concatenate([np.asarray(a) for a in rows["accept"]])
    assert 0.3 < accept.mean() < 0.85  # layers 20-21 skipped: a real, imperfect draft
    tokenizer = load_tokenizers(ModelSpec(path="embedded:smollm2"), ModelSpec(skip_layers=[20, 21]))
    assert tokenizer.decode(rows[0]["prompt_ids"]).rstrip().endswith("<|im_start|>assistant")
    assert np.asarray(rows[0]["features"]).shape == (len(rows[0]["target_ids"]) + 1, 576)
    # the demo config stores the state after 20 draft layers: the target's own state where the skipped block starts
    assert manifest["identity"]["state_layer"] == 20
    target = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(skip_layers=[20, 21]), tokenizer).target
    row = rows.with_format("numpy")[0]
    with torch.no_grad():
        states = target.model(torch.tensor([list(row["prompt_ids"]) + list(row["mixed_ids"])]),
                              output_hidden_states=True).hidden_states[20][0, len(row["prompt_ids"]) - 1:]
    assert np.allclose(np.asarray(row["features"], dtype=np.float32), states.numpy(), atol=0.1, rtol=1e-2)


def test_a_greedy_tree_on_the_embedded_pair_decodes_the_targets_greedy_tokens():
    """The 4D tree mask through SmolLM2's attention: a tree of 8 nodes, 2 children a node, decodes exactly the
    target's argmax chain, and some rounds accept several tokens."""
    from specheads.dataset.prompts import encode_prompt, load_prompts
    from specheads.decoding import RoundEngine
    from specheads.decoding.tree import TreeRule, decode_tree
    from specheads.model_outputs.sampling import SamplingTransform

    pair = load_pair(ModelSpec(path="embedded:smollm2"), ModelSpec(skip_layers=[20, 21]))
    prompt = encode_prompt(pair.tokenizer, load_prompts("benchmarks/prompts/heldout_confirm.jsonl")[1])
    with torch.no_grad():
        expected = pair.target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                        max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    engine = RoundEngine(pair.target, pair.draft, SamplingTransform(0.0), stop_ids=[])
    result = decode_tree(engine, [prompt], TreeRule("confidence", floor=0.0, budget=8, width=2), 16, [0])[0]
    assert result.tokens == expected
    assert max(result.accepted_per_round) > 1 and result.target_calls < 16
