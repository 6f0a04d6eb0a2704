"""Run in vLLM's environment by tests/test_vllm_proposer.py: (1) on repetitive contexts, our proposer without a head
drafts what vLLM's own NgramProposer drafts; (2) vLLM serves a tiny random Llama (the test's tokenizer, a head width
vLLM's CPU attention takes) at T = 0 without speculation and with `LookupHeadProposer` cutting drafts with a head, and
the outputs are compared token for token. Writes result.json beside LOG_FILE.

Usage: vllm_proposer_serve.py TINY_MODEL_FOLDER HEAD_FOLDER LOG_FILE
"""

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def ngram_equal() -> bool:
    """Our proposer without a head against vLLM's NgramProposer (n 1-3, K 4) on the same arrays."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    from specheads.integrations.vllm import LookupHeadProposer

    spec = SimpleNamespace(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                           suffix_decoding_max_tree_depth=24, suffix_decoding_max_spec_factor=1.0,
                           suffix_decoding_min_token_prob=0.1)
    config = SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(max_model_len=64),
                             scheduler_config=SimpleNamespace(max_num_seqs=8),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1), additional_config={})
    theirs, ours = NgramProposer(config), LookupHeadProposer(config)
    rng = np.random.default_rng(0)
    tokens = np.zeros((8, 64), dtype=np.int32)
    counts = rng.integers(8, 60, size=8).astype(np.int32)
    for row, count in enumerate(counts):
        tokens[row, :count] = rng.integers(1, 6, size=count)
    sampled = [[int(tokens[row, count - 1])] for row, count in enumerate(counts)]
    return theirs.propose(4, sampled, counts, tokens) == ours.propose(sampled, counts, tokens)


def tiny_for_vllm(folder: Path, out: Path) -> Path:
    """The tiny target with a head width of 64 (vLLM's CPU attention kernels), its tokenizer kept."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(folder)
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 128, 256, 2
    config.num_key_value_heads, config.head_dim = 1, 64
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in os.listdir(folder):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(folder / name, out / name)
    return out


def serve(model: Path, head: Path, log: Path) -> dict:
    """Greedy outputs without speculation and with the proposer; the proposer's drafted and accepted totals."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(1)
    prompts = []
    for _ in range(4):
        phrase = rng.integers(10, 200, size=6).tolist()
        prompts.append(TokensPrompt(prompt_token_ids=phrase * 4 + rng.integers(10, 200, size=3).tolist() + phrase[:2]))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(model=str(model), dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=4)
    outputs = {}
    llm = LLM(**common)
    outputs["plain"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    del llm
    spec = {"method": "custom_class", "model": "specheads.integrations.vllm.LookupHeadProposer",
            "num_speculative_tokens": 4}
    llm = LLM(**common, speculative_config=spec, disable_log_stats=False, per_request_spec_decode_metrics="detailed",
              additional_config={"specheads": {"head": str(head), "log": str(log), "token_cost": 0.05}})
    served = llm.generate(prompts, greedy, use_tqdm=False)
    outputs["ours"] = [list(o.outputs[0].token_ids) for o in served]
    metrics = [o.outputs[0].spec_decode_metrics for o in served]
    drafted = sum(sum(m.per_step_drafted) for m in metrics if m is not None)
    accepted = sum(sum(m.per_step_accepted) for m in metrics if m is not None)
    del llm
    # SuffixDecoding's trees (arctic-inference) read further, as our decoder's suffix_plan reads them, uncut
    suffix = {**spec, "suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.0}
    llm = LLM(**common, speculative_config=suffix, disable_log_stats=False, per_request_spec_decode_metrics="detailed",
              additional_config={"specheads": {"draft": "suffix", "log": str(log.with_name("suffix.jsonl"))}})
    served = llm.generate(prompts, greedy, use_tqdm=False)
    outputs["ours_suffix"] = [list(o.outputs[0].token_ids) for o in served]
    suffix_drafted = sum(sum(o.outputs[0].spec_decode_metrics.per_step_drafted) for o in served)
    return {"prompts": len(prompts), "identical": [a == b for a, b in zip(outputs["plain"], outputs["ours"])],
            "drafted": drafted, "accepted": accepted, "suffix_drafted": suffix_drafted,
            "suffix_identical": [a == b for a, b in zip(outputs["plain"], outputs["ours_suffix"])]}


if __name__ == "__main__":
    tiny, head, log = (Path(a) for a in sys.argv[1:4])
    result = {"ngram_equal": ngram_equal()}
    result |= serve(tiny_for_vllm(tiny, log.parent / "tiny-vllm"), head, log)
    (log.parent / "result.json").write_text(json.dumps(result))  # vLLM prints after this script's last line
    print(json.dumps(result), flush=True)
