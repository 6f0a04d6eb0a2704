"""EAGLE-3 drafters (issue 61): the target features they read, the training recipe (`specheads train drafter`) on the
tiny target, and the speculators-format folder it writes. The tests that build a drafter need speculators (the
`eagle3` extra) and are skipped without it; the others run everywhere."""

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from specheads.cli import main
from specheads.pair.drafters import target_features
from specheads.plumbing.config_files import resolve_config
from specheads.plumbing.dataclass_cli import parse_dataclass
from specheads.train.drafter import DrafterConfig, collate, pack
from specheads.train.drafter_data import Sequence

CONFIG = Path(__file__).parents[1] / "configs" / "train" / "eagle3-smollm2.yaml"


def recipe_args(tiny_model: Path, prompts_file: Path, out: Path, *extra: str) -> list[str]:
    """`specheads train drafter` on the tiny target: 12 prompts × 2 responses, a 64-token draft vocabulary."""
    return ["train", "drafter", "--target.path", str(tiny_model), "--verifier-name", "tiny", "--prompts", str(prompts_file),
            "--samples-per-prompt", "2", "--max-new-tokens", "12", "--chunk-prompts", "4", "--val-fraction", "0.25",
            "--layer-ids", "[1, 2, 3]", "--draft-vocab-size", "64", "--tokens-per-batch", "64", "--warmup-steps", "2",
            "--val-every", "5", "--checkpoint-every", "5", "--accelerator", "cpu", "--out", str(out), *extra]


def test_the_shipped_recipe_config_parses_and_names_the_embedded_target():
    config = parse_dataclass(DrafterConfig, ["--config", resolve_config("eagle3-smollm2", "train")], "t", "")
    assert config.target.path == "embedded:smollm2" and config.temperature == 1.0 and config.layer_ids is None
    assert config.draft_vocab_size == 8192 and config.num_layers == 1 and str(CONFIG) == resolve_config(str(CONFIG), "train")


def test_target_features_are_the_streams_entering_the_fused_layers(tiny_model):
    # vLLM's convention: layer id i is the residual stream entering layer i (transformers' hidden_states[i]); the
    # last state is the last layer's output before the final norm (transformers' last hidden_states is after it)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = torch.tensor([[5, 9, 30, 41, 7], [8, 3, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    aux, last = target_features(model, ids, mask, [0, 1, 3])
    with torch.no_grad():
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    width = model.config.hidden_size
    for slot, layer in enumerate([0, 1, 3]):
        assert torch.allclose(aux[..., slot * width:(slot + 1) * width], states[layer], atol=1e-6)
    assert torch.allclose(model.model.norm(last), states[-1], atol=1e-5)
    assert not torch.allclose(last, states[-1])


def sequence(tokens: list[int], prompt: int, width: int = 2) -> Sequence:
    size = len(tokens)
    return Sequence(torch.tensor(tokens), torch.arange(size) >= prompt, torch.arange(size * 3 * width).reshape(size, -1).float(),
                    -torch.arange(size * width).reshape(size, width).float(), 0)


def test_a_packed_batch_pairs_each_token_with_the_features_before_it():
    rows = [sequence([10, 11, 12, 13], 2), sequence([20, 21, 22], 1)]
    batch = collate(rows, tokens=64)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1]] and batch["position_ids"].tolist() == [[1, 2, 3, 1, 2]]
    assert torch.equal(batch["hidden_states"][0, :3], rows[0].aux[:3]) and torch.equal(batch["hidden_states"][0, 3:], rows[1].aux[:2])
    assert torch.equal(batch["verifier_last_hidden_states"][0, :3], rows[0].last[1:])
    assert batch["loss_mask"].tolist() == [[False, True, True, True, True]]
    assert collate(rows, tokens=3)["input_ids"].tolist() == [[11, 12, 21, 22]]  # each sequence cut to 3 tokens
    packed = pack([sequence(list(range(n)), 1) for n in (40, 30, 30, 10)], tokens=64, seed=None)
    assert packed == [[0], [1, 2], [3]]


def test_without_speculators_the_recipe_refuses_in_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "speculators.models", None)  # what a missing package does to the import
    out = tmp_path / "run"
    assert main(["train", "drafter", "--target.path", str(tmp_path / "no-such-model"), "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "pip install --no-deps speculators==0.9.0" in error
    assert not out.exists() or not any(out.iterdir())


@pytest.fixture(scope="module")
def recipe(tiny_model, prompts_file, tmp_path_factory):
    pytest.importorskip("speculators.models.eagle3")
    out = tmp_path_factory.mktemp("eagle3") / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, "--max-steps", "10", "--lr", "3e-3")) == 0
    return out


def test_the_recipe_trains_and_writes_a_speculators_folder_and_a_fingerprint(recipe, tiny_model):
    from transformers import AutoModelForCausalLM

    from specheads.pair.drafters import draft_to_target
    from specheads.pair.eagle3 import load_drafter

    fingerprint = json.loads((recipe / "fingerprint.json").read_text())
    assert fingerprint["steps"] == 10 and len(fingerprint["data_digest"]) == 16 and fingerprint["train_seconds"] > 0
    config = json.loads((recipe / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and not list((recipe / "drafter").glob("*.py"))
    with open(recipe / "train" / "metrics.csv") as handle:
        losses = [float(row["val/loss"]) for row in csv.DictReader(handle) if row.get("val/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]  # it learns: the held-out loss at step 10 is below step 5's
    target = AutoModelForCausalLM.from_pretrained(tiny_model)
    drafter = load_drafter(recipe / "drafter", target)
    head = target.get_output_embeddings().weight
    assert torch.equal(drafter.verifier_lm_head.weight, head[draft_to_target(drafter.d2t)])
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    assert int(drafter.t2d.sum()) == 64 and torch.equal(torch.nonzero(drafter.t2d).flatten(), draft_to_target(drafter.d2t))


def test_a_rerun_reuses_the_data_and_resumes_the_training(recipe, tiny_model, prompts_file):
    chunks = {path: path.stat().st_mtime_ns for path in (recipe / "data").glob("chunk-*.safetensors")}
    assert main(recipe_args(tiny_model, prompts_file, recipe, "--max-steps", "12", "--lr", "3e-3")) == 0
    assert {path: path.stat().st_mtime_ns for path in (recipe / "data").glob("chunk-*.safetensors")} == chunks
    assert json.loads((recipe / "fingerprint.json").read_text())["steps"] == 12
    assert "resuming from" in (recipe / "recipe.log").read_text()


def test_data_made_with_other_settings_is_refused(recipe, tiny_model, prompts_file, capsys):
    assert main(recipe_args(tiny_model, prompts_file, recipe, "--max-new-tokens", "9")) == 2
    assert "other settings (max_new_tokens)" in capsys.readouterr().err


@pytest.mark.parametrize("flags, problem", [(["--layer-ids", "[1, 1, 2]"], "--layer-ids [1, 1, 2] must be three distinct"),
                                            (["--layer-ids", "[1, 2, 5]"], "target layers in 0..4"),
                                            (["--draft-vocab-size", "100000"], "exceeds the target's vocabulary")])
def test_bad_settings_are_refused_in_one_line_before_anything_is_written(tiny_model, prompts_file, tmp_path, capsys,
                                                                          flags, problem):
    pytest.importorskip("speculators.models.eagle3")
    out = tmp_path / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, *flags)) == 2
    error = capsys.readouterr().err.strip()
    assert problem in error and error.count("\n") == 0 and not out.exists()


def test_profile_refuses_an_eagle3_folder_that_is_not_a_drafter_before_loading_anything(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["profile", "--eagle3", str(tmp_path / "empty"), "--out", str(tmp_path / "costs.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert "give the folder of a drafter" in error and error.count("\n") == 0 and not (tmp_path / "costs.json").exists()


@pytest.mark.parametrize("script, flags, problem", [
    ("eagle3_decode", ["--rules", '["confidence:nan"]'], "the confidence rule's threshold must be a finite number >= 0"),
    ("eagle3_decode", ["--rules", '["confidence:-0.3"]'], "got -0.3"),
    ("eagle3_decode", ["--rules", '["tree:nan"]'], "the tree's floor is a probability"),
    ("eagle3_decode", ["--rules", '["confidence"]'], "is not name:threshold"),
    ("eagle3_decode", ["--prompts", "0"], "--prompts 0 must be at least 1"),
    ("dspark_decode", ["--rules", '["bogus:1"]'], "unknown decoding rule 'bogus'"),
    ("dspark_decode", ["--temperature", "1e999"], "--temperature holds inf"),  # YAML reads it as infinity
    ("decode_speed", ["--confidence", "[0.1, .nan]"], "--confidence holds nan"),
    ("decode_speed", ["--svip", "[-1.0]"], "the svip rule's threshold must be a finite number >= 0"),
])
def test_a_benchmarks_bad_flags_end_in_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, script, flags,
                                                                       problem):
    """The check every benchmark's flags get in the shared parser (`parse_script`): the target named here does not
    exist, so a refusal naming the flag comes before any model is looked for."""
    from conftest import load_benchmark

    module = load_benchmark(script)
    drafter = ["--drafter", str(tmp_path / "drafter")] if script != "decode_speed" else []
    monkeypatch.setattr(sys, "argv", [script, *drafter, "--target", str(tmp_path / "no-target"), *flags]
                        if script != "decode_speed" else [script, *flags])
    with pytest.raises(SystemExit) as ended:
        module.main()
    message = str(ended.value)
    assert problem in message and "\n" not in message and message.startswith(f"{script}.py: error:")
