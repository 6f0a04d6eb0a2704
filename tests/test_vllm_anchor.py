"""benchmarks/vllm_anchor.py (issue 61): the pure parts of the vLLM-CPU anchor, which runs in vLLM's own environment
(never here): reading vLLM's speculative-decoding counters, the accepted length and per-position acceptance with their
intervals, the configs and weights as vLLM must read the embedded pair, and the CPU expand kernel's stand-in."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import load_benchmark
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def anchor():
    return load_benchmark("vllm_anchor")


def counters(anchor, rounds: list[int], k: int) -> list[SimpleNamespace]:
    """vLLM's counters (as `LLM.get_metrics()` gives them) after rounds that accepted `rounds[i]` of `k` drafts."""
    per = [sum(a > j for a in rounds) for j in range(k)]
    return [SimpleNamespace(name=anchor.DRAFTS, value=len(rounds)),
            SimpleNamespace(name=anchor.DRAFT_TOKENS + "_total", value=k * len(rounds)),
            SimpleNamespace(name=anchor.ACCEPTED, value=sum(rounds)),
            SimpleNamespace(name=anchor.PER_POSITION, values=per),
            SimpleNamespace(name="vllm:num_requests_running", value=3)]


def test_the_accepted_length_and_acceptance_per_position_are_those_of_the_rounds_the_counters_saw(anchor):
    """Rounds accepting 0, 1, 2, 2, 0, 1, 2, 0 of K = 2 after 3 earlier rounds: the counters' gain is the 8 rounds; the
    mean accepted length is 1 + their mean with a normal interval from their own spread; position 1 accepts 5 of 8
    rounds, position 2 3 of the 5 that reached it."""
    earlier, rounds = [2, 0, 1], [0, 1, 2, 2, 0, 1, 2, 0]
    before = anchor.spec_counts(counters(anchor, earlier, 2))
    gained = anchor.counts_between(before, anchor.spec_counts(counters(anchor, earlier + rounds, 2)))
    assert gained == {"drafts": 8, "draft_tokens": 16, "accepted": 8, "accepted_per_position": [5, 3]}
    summary = anchor.acceptance(gained)
    mean = sum(rounds) / len(rounds)
    spread = math.sqrt(sum((a - mean) ** 2 for a in rounds) / len(rounds) / len(rounds))
    assert summary["mean_accepted_length"] == pytest.approx(1 + mean, abs=1e-4)
    assert summary["mean_accepted_length_interval"] == pytest.approx([1 + mean - 1.96 * spread, 1 + mean + 1.96 * spread],
                                                                     abs=1e-3)
    assert summary["acceptance_per_position"] == [0.625, 0.6]
    assert summary["acceptance_intervals"][1] == anchor.wilson(3, 5)
    assert anchor.wilson(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)
    assert anchor.wilson(0, 10)[0] == 0 and anchor.acceptance(anchor.counts_between(before, before))["acceptance_per_position"] == []


def test_the_embedded_pair_is_handed_to_vllm_without_its_gguf_marks_and_with_its_tied_head_as_embeddings(anchor):
    """The conversion leaves `quantization_config: gguf` in the target's config and the drafter's layer config (vLLM
    would read GGUF weights) and no architecture; a tied checkpoint holding only `lm_head.weight` is renamed, since
    vLLM would untie it and leave the embeddings unloaded."""
    gguf = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    target = anchor.serving_config({"model_type": "llama", "quantization_config": gguf, "tie_word_embeddings": True})
    assert target == {"model_type": "llama", "tie_word_embeddings": True, "architectures": ["LlamaForCausalLM"]}
    drafter = anchor.serving_config({"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                                     "transformer_layer_config": {"model_type": "llama", "quantization_config": gguf}})
    assert drafter["architectures"] == ["Eagle3DraftModel"] and "quantization_config" not in drafter["transformer_layer_config"]
    assert anchor.tied_renames(["lm_head.weight", "model.norm.weight"], {"tie_word_embeddings": True}) == {
        "lm_head.weight": "model.embed_tokens.weight"}
    assert anchor.tied_renames(["lm_head.weight", "model.embed_tokens.weight"], {"tie_word_embeddings": True}) == {}
    assert anchor.tied_renames(["lm_head.weight"], {"tie_word_embeddings": False}) == {}


def test_the_expand_stand_in_writes_each_requests_value_over_its_tokens_at_the_callers_dtype(anchor):
    """vLLM's expand kernel: temperatures 0.7 (2 drafts), greedy (-1, read as 1; 3 drafts), 0.5 (1 draft) fill six
    float slots untruncated; top-k values stay int32; the slots past the drafted tokens are left alone."""
    out = torch.full((7,), -9.0)
    anchor.expand_at_dtype(out, torch.tensor([0.7, -1.0, 0.5]), torch.tensor([2, 5, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.5, -9.0])
    top_k = torch.empty(3, dtype=torch.int32)
    anchor.expand_at_dtype(top_k, torch.tensor([50, 0], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    assert top_k.tolist() == [50, 0, 0] and top_k.dtype == torch.int32


def folders(tmp_path, drafter_config=None):
    """A target folder, a drafter folder and a prompt file as the anchor reads them (files only, no weights)."""
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    for folder, config in ((target, {"model_type": "llama", "eos_token_id": 2}),
                           (drafter, drafter_config or {"speculators_model_type": "eagle3"})):
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(2, 2)}, str(drafter / "model.safetensors"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(5)) + "\n")
    return ["--target", str(target), "--drafter", str(drafter), "--prompt-file", str(prompts)]


def test_a_row_is_skipped_only_where_everything_that_changes_it_is_the_same(anchor, tmp_path):
    """The cache key holds the drafter's and target's files, the prompt file and max new tokens beside K, T and B:
    another drafter in the same folder, another max_new_tokens or another prompt file reruns the row."""
    paths = folders(tmp_path)
    args = anchor.parse_args([*paths, "--k", "2", "--prompts", "40"])
    identity = anchor.run_identity(args)
    assert identity["prompts"] == 5  # the prompts the file holds, as the row records them
    out = tmp_path / "anchor.jsonl"
    out.write_text(json.dumps({**identity, "temperature": 1.0, "batch": 8, "tokens": 10}) + "\n")
    assert anchor.row_key({**identity, "temperature": 1.0, "batch": 8}) in anchor.done_rows(out)
    assert anchor.row_key({**identity, "temperature": 1.0, "batch": 1}) not in anchor.done_rows(out)
    longer = anchor.run_identity(anchor.parse_args([*paths, "--k", "2", "--max-new-tokens", "128"]))
    assert anchor.row_key({**longer, "temperature": 1.0, "batch": 8}) not in anchor.done_rows(out)
    save_file({"fc.weight": torch.ones(2, 2)}, str(tmp_path / "drafter" / "model.safetensors"))
    retrained = anchor.run_identity(args)
    assert anchor.row_key({**retrained, "temperature": 1.0, "batch": 8}) not in anchor.done_rows(out)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "other"}) + "\n")
    assert anchor.run_identity(args)["prompt_file_sha256"] != retrained["prompt_file_sha256"]


def test_another_drafter_never_finds_the_copy_made_for_an_earlier_one(anchor, tmp_path):
    paths = folders(tmp_path, {"speculators_model_type": "eagle3", "draft_vocab_size": 64})
    args = anchor.parse_args([*paths, "--k", "2"])
    work = tmp_path / "work"
    first = anchor.serving_copy(tmp_path / "drafter", work, "drafter", anchor.run_identity(args)["drafter_sha256"])
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                                  "draft_vocab_size": 128}))
    second = anchor.serving_copy(tmp_path / "drafter", work, "drafter", anchor.run_identity(args)["drafter_sha256"])
    assert first != second and json.loads((second / "config.json").read_text())["draft_vocab_size"] == 128
    assert sorted(p.name for p in work.iterdir()) == sorted([first.name, second.name])  # no staging folder left


def test_the_stop_ids_are_ours_the_generation_configs_else_the_tokenizers(anchor, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert anchor.stop_ids(target, 7) == [2]  # transformers derives the generation config from config.json
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert anchor.stop_ids(target, 7) == [2, 0]
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert anchor.stop_ids(target, 7) == [7]


@pytest.mark.parametrize("flags, problem", [(["--k", "-1"], "--k -1 must be at least 0"),
                                            (["--k", "2", "--batches", "0", "8"], "--batches [0, 8] must be at least 1"),
                                            (["--k", "2", "--temperatures", "nan"], "must be finite"),
                                            (["--k", "2", "--max-new-tokens", "0"], "--max-new-tokens 0 must be"),
                                            (["--k", "2", "--drafter", "/nonexistent"], "--drafter /nonexistent holds no")])
def test_bad_flags_end_in_one_line_before_vllm_is_imported(anchor, tmp_path, flags, problem):
    with pytest.raises(SystemExit) as ended:
        anchor.main([*folders(tmp_path), *flags])
    message = str(ended.value)
    assert problem in message and "\n" not in message and message.startswith("vllm_anchor.py: error:")
