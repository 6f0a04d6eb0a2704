"""DSpark drafters' recipe (`specheads train drafter --algorithm dspark`, issue 63): the shipped config, a tiny drafter
trained a few steps on the tiny target with its confidence head, resumed, written in speculators' format and drafting
in the decoding core; the aligned batches the DFlash family reads; the drafter data's stop tokens."""

import json
from types import SimpleNamespace

import pytest
import torch
from test_eagle3 import recipe_args, sequence
from test_eval import tiny_lm

from specheads.cli import main
from specheads.plumbing.config_files import resolve_config
from specheads.plumbing.dataclass_cli import parse_dataclass
from specheads.train.drafter import DrafterConfig, collate
from specheads.train.drafter_data import sample_responses

DSPARK = ("--algorithm", "dspark", "--block-size", "4", "--markov-rank", "8", "--max-anchors", "8")


def test_the_shipped_dspark_recipe_config_parses_and_names_the_embedded_target():
    config = parse_dataclass(DrafterConfig, ["--config", resolve_config("dspark-smollm2", "train")], "t", "")
    config.check_algorithm()
    assert config.algorithm == "dspark" and config.target.path == "embedded:smollm2" and config.out == "runs/dspark"
    assert config.block_size == 8 and config.markov_head_type == "vanilla" and config.confidence_head
    assert config.mask_token_id is None and config.layer_ids is None and config.temperature == 1.0


def test_an_aligned_batch_pairs_each_token_with_its_own_features():
    rows = [sequence([10, 11, 12, 13], 2), sequence([20, 21, 22], 1)]
    batch = collate(rows, tokens=64, shift=False)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]] and batch["document_ids"].tolist() == [[0] * 4 + [1] * 3]
    assert torch.equal(batch["hidden_states"][0, :4], rows[0].aux)
    assert torch.equal(batch["verifier_last_hidden_states"][0, 4:], rows[1].last)
    assert batch["loss_mask"].tolist() == [[False, False, True, True, False, True, True]]


def test_drafter_data_ends_each_response_at_a_stop_token_whose_id_is_zero():
    """A stop id of 0 is a stop id (SmolLM2's <|endoftext|> is 0): each response ends at its first 0."""
    target = tiny_lm(seed=3)
    target.generation_config.eos_token_id = 0
    tokenizer = SimpleNamespace(pad_token_id=2, eos_token_id=None)
    responses = sample_responses(target, tokenizer, [[1, 2], [2]], samples=8, max_new_tokens=12, temperature=1.0, seed=0)
    ended = [tokens for _, tokens in responses if 0 in tokens]
    assert len(ended) > 4 and all(tokens.index(0) == len(tokens) - 1 for tokens in ended)


@pytest.fixture(scope="module")
def recipe(tiny_model, prompts_file, tmp_path_factory):
    pytest.importorskip("speculators.models.dspark")
    out = tmp_path_factory.mktemp("dspark") / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, *DSPARK, "--max-steps", "10", "--lr", "3e-3")) == 0
    return out


def test_the_recipe_trains_a_dspark_drafter_with_its_confidence_head_and_writes_a_speculators_folder(recipe, tiny_model):
    from transformers import AutoModelForCausalLM

    from specheads.decoding.dspark import dspark_decode
    from specheads.model_outputs.sampling import SamplingTransform
    from specheads.pair.dspark import load_drafter

    fingerprint = json.loads((recipe / "fingerprint.json").read_text())
    assert fingerprint["algorithm"] == "dspark" and fingerprint["steps"] == 10 and fingerprint["train_seconds"] > 0
    held = fingerprint["held_out"]
    assert 1.0 <= held["val/accept_len"] <= 5.0 and 0.0 <= held["val/confidence_abs_error"] <= 1.0
    config = json.loads((recipe / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["block_size"] == 4 and config["draft_vocab_size"] == 64
    assert config["mask_token_id"] == fingerprint["mask_token_id"] is not None and config["enable_confidence_head"]
    assert not list((recipe / "drafter").glob("*.py"))
    target = AutoModelForCausalLM.from_pretrained(tiny_model)
    drafter = load_drafter(recipe / "drafter", target)
    trained = torch.load(recipe / "train" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert torch.allclose(drafter.confidence_head.proj.weight, trained["drafter.confidence_head.proj.weight"].to(torch.float16).float())
    assert not any(name.startswith("drafter.embed_tokens") for name in trained)  # the target's weights are not saved
    result = dspark_decode(target, drafter, [5, 9, 30, 41], SamplingTransform(1.0), 4, 12, seed=0)
    assert len(result.tokens) == 12 and result.draft_forwards > 0 and all(len(s) for s in result.confidence)


def test_a_dspark_rerun_reuses_the_data_and_resumes_the_training(recipe, tiny_model, prompts_file):
    chunks = {path: path.stat().st_mtime_ns for path in (recipe / "data").glob("chunk-*.safetensors")}
    assert main(recipe_args(tiny_model, prompts_file, recipe, *DSPARK, "--max-steps", "12", "--lr", "3e-3")) == 0
    assert {path: path.stat().st_mtime_ns for path in (recipe / "data").glob("chunk-*.safetensors")} == chunks
    assert json.loads((recipe / "fingerprint.json").read_text())["steps"] == 12
    assert "resuming from" in (recipe / "recipe.log").read_text()


@pytest.mark.parametrize("flags, problem", [
    (["--algorithm", "dspark", "--ttt-steps", "5"], "--ttt-steps is a setting of the other drafter"),
    (["--block-size", "4"], "--block-size is a setting of the other drafter, not of --algorithm eagle3"),
    (["--algorithm", "dspark", "--mask-token-id", "100000"], "mask_token_id 100000 is not a token"),
    (["--algorithm", "dspark", "--layer-ids", "[1, 1]"], "--layer-ids [1, 1] must be distinct target layers in 0..4"),
    (["--algorithm", "dspark", "--sample-from-anchor", "false", "--block-size", "1"], "block_size 1 drafts no candidate")])
def test_bad_dspark_settings_are_refused_in_one_line_before_anything_is_written(tiny_model, prompts_file, tmp_path, capsys,
                                                                                 flags, problem):
    pytest.importorskip("speculators.models.dspark")
    out = tmp_path / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, *flags)) == 2
    error = capsys.readouterr().err.strip()
    assert problem in error and error.count("\n") == 0 and not out.exists()

