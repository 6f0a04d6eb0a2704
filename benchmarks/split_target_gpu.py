"""GPU check (issue 48, split models): a tiny random target split between cuda:0 and the CPU by `device_map`, with a
draft derived from it (so split the same way), decodes greedily token for token as the target alone does, through
the round engine (chain and tree) and `speculative_generate`; a sampled run goes through the p/q test on the split
(a crash check: exactness under sampling is the CPU chi-square tests').

Both splits are run: the embeddings on cuda:0 and the last layers, norm and LM head on the CPU (a CPU tensor indexed
by cuda:0 indices crashed here), and the reverse. Needs one GPU; about a minute.

    python benchmarks/split_target_gpu.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [[5, 9, 1], [30, 2, 2, 7, 11], [4]]
NEW = 24


def split_map(first: int | str, last: int | str) -> dict[str, int | str]:
    return {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first, "model.layers.1": first,
            "model.layers.2": last, "model.layers.3": last, "model.norm": last, "lm_head": last}


def check(folder: Path, first: int | str, last: int | str) -> None:
    from specheads.decoding import RoundEngine, make_policy
    from specheads.decoding.tree import TreeRule, decode_tree
    from specheads.heads import OnTimeAcceptanceHead
    from specheads.heads.loading import DecisionRule
    from specheads.integrations.transformers import speculative_generate
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.models import without_layers

    target = AutoModelForCausalLM.from_pretrained(folder, device_map=split_map(first, last)).eval()
    target.generation_config.eos_token_id = target.generation_config.bos_token_id = None
    target.generation_config.pad_token_id = 0
    draft = without_layers(target, [1])
    expected = [target.generate(torch.tensor([p], device=target.device), do_sample=False, max_new_tokens=NEW)[0, len(p):].tolist()
                for p in PROMPTS]
    engine = RoundEngine(target, draft, SamplingTransform(0.0), stop_ids=[])
    seeds = list(range(len(PROMPTS)))
    chain = [r.tokens for r in engine.decode(PROMPTS, make_policy("constant_k", 4), NEW, seeds)]
    refilled = [r.tokens for r in engine.decode(PROMPTS, make_policy("constant_k", 4), NEW, seeds, batch_size=1)]
    tree = [r.tokens for r in decode_tree(engine, PROMPTS, TreeRule("confidence", floor=0.05, budget=6, width=2), NEW, seeds)]
    assert chain == refilled == tree == expected, (chain, refilled, tree, expected)
    torch.manual_seed(11)
    head = OnTimeAcceptanceHead(32, depth=1, extra_features=["logq", "q"], candidate_embedding_size=32).eval()
    rule = DecisionRule("stop_drafting_when_rejection_risk_above", 0.5, True, max_draft=3)
    for prompt, tokens in zip(PROMPTS, expected):
        ids = torch.tensor([prompt], device=target.device)
        ours = target.generate(ids, do_sample=False, max_new_tokens=NEW, custom_generate=speculative_generate,
                               draft=draft, head=(head, rule))
        assert ours[0, len(prompt):].tolist() == tokens
    sampled = target.generate(torch.tensor([PROMPTS[0]] * 4, device=target.device), do_sample=True, top_k=0,
                              max_new_tokens=NEW, custom_generate=speculative_generate, draft=draft, head=(head, rule))
    # a crash check: the p/q test meets the split's p and the draft's q (the defect was a device error there)
    assert sampled.shape == (4, len(PROMPTS[0]) + NEW) and int(sampled.max()) < config_vocab(target)
    print(f"split {first} -> {last}: greedy chain, refilled rows, tree and speculative_generate equal the target's "
          f"generate; sampling ran ({getattr(target, 'hf_device_map', None)})")


def config_vocab(model: torch.nn.Module) -> int:
    return int(model.config.vocab_size)


def main() -> None:
    assert torch.cuda.is_available(), "this check needs a GPU"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.4,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        check(Path(folder), 0, "cpu")
        check(Path(folder), "cpu", 0)
    print("ok")


if __name__ == "__main__":
    main()
