"""What a new user sees: help that describes every option in the README's spelling, a fast one-line failure for a
Hub id with no network, and no third-party noise on stderr."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import build_tiny_model, run_cli, tiny_args

from specheads.cli import main

FLAG_WITH_UNDERSCORE = re.compile(r"--[\w.-]*_")
CONFIGS = Path(__file__).parents[1] / "configs"


def help_text(capsys, monkeypatch, command: str) -> str:
    """`specheads COMMAND --help` as printed, 100 columns wide."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def options(text: str) -> dict[str, str]:
    """Each option's invocation (`--num-prompts NUM_PROMPTS`) and its description, from argparse's layout: the
    invocation at indent 2, its description after two spaces or on the lines below it."""
    found: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current, _, description = line.strip().partition("  ")
            found[current] = description.strip()
        elif current and line.startswith("   "):
            found[current] = f"{found[current]} {line.strip()}".strip()
        else:
            current = None
    return found


@pytest.mark.parametrize("command, minimum", [("gen", 40), ("eval", 20), ("export", 7), ("demo", 4), ("profile", 20)])
def test_every_option_is_described_in_dash_spelling(capsys, monkeypatch, command, minimum):
    text = help_text(capsys, monkeypatch, command)
    described = options(text)
    assert len(described) >= minimum, text
    # jsonargparse appends "(type: ..., default: ...)" to every option: a description is text before it
    bare = [invocation for invocation, description in described.items() if not description or description.startswith("(")]
    assert not bare, f"options without a description: {bare}"
    usage = text.split("\n\n")[0]
    shown = " ".join([usage, *described])
    assert not FLAG_WITH_UNDERSCORE.search(shown), FLAG_WITH_UNDERSCORE.findall(shown)


def test_gen_help_shows_the_readme_spellings_and_they_parse(capsys, monkeypatch):
    from specheads.data_gen.cli import parse_config

    text = help_text(capsys, monkeypatch, "gen")
    for flag in ("--num-prompts", "--samples-per-prompt", "--store-features", "--state-layer", "--batch-size",
                 "--sampling.max-new-tokens", "--max-new-tokens"):
        assert flag in text, flag
    config = parse_config(["--num-prompts", "3", "--sampling.max-new-tokens", "7", "--state-layer", "2"])
    assert (config.num_prompts, config.sampling.max_new_tokens, config.state_layer) == (3, 7, 2)


def test_train_help_names_specheads_train_without_a_lightning_warning():
    done = run_cli(["train", "--help"], timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.lstrip().startswith("usage: specheads train "), output[:300]
    assert "LightningCLI" not in output and "warn" not in output.lower(), output[:600]


NO_NETWORK = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
"""A Hub endpoint nothing listens on: what no network looks like."""


def hub_requests(args: list[str], env: dict[str, str], repo_id: str) -> list[str]:
    """The requests for `repo_id` to the Hub, and any retry, that `specheads ARGS` makes, as huggingface_hub logs them
    with HF_DEBUG=1 where `--debug` lets its logging through: each would wait on the network, then on its retries (over
    20 s). (huggingface_hub's own daily fetch of its agent registry, which gives up at once, is not ours.)"""
    done = run_cli([*args, "--debug"], timeout=120, env={**env, "HF_DEBUG": "1"})
    return [line for line in done.stderr.splitlines()
            if (line.startswith("Request ") and repo_id in line) or "Retrying in" in line]


def test_hub_id_without_network_fails_fast_in_one_whole_line(tmp_path, prompts_file):
    env = {**NO_NETWORK, "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    args = tiny_args("some-org/not-cached-model", prompts_file, tmp_path / "out")
    done = run_cli(args, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no retry chatter before it
    line = lines[0]
    assert line.startswith("specheads gen: error: cannot load model 'some-org/not-cached-model'"), line
    assert "no connection to 127.0.0.1" in line and "nor in the Hugging Face cache" in line, line
    assert line.endswith("connect to the network, or pass a local folder or .gguf file"), line  # whole, not cut
    assert hub_requests(args, env, "some-org/not-cached-model") == []
    assert not (tmp_path / "out").exists()


def test_cached_hub_id_is_read_from_the_cache_without_network(tmp_path, prompts_file):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--me--tiny"  # huggingface_hub's cache layout, as a download leaves it
    build_tiny_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**NO_NETWORK, "HF_HOME": str(tmp_path / "hf")}
    args = tiny_args("me/tiny", prompts_file, tmp_path / "out", "--num-prompts", "2")
    assert hub_requests(args, env, "me/tiny") == []
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["identity"]["target"]["revision"] == commit  # the snapshot's commit identifies the weights


@pytest.fixture(scope="module")
def labelled(tiny_model, prompts_file, tmp_path_factory) -> Path:
    """A tiny labelled dataset."""
    data = tmp_path_factory.mktemp("quiet") / "gen"
    assert main(tiny_args(tiny_model, prompts_file, data, "--num-prompts", "4")) == 0
    return data


def test_gen_keeps_third_party_noise_off_stderr_unless_debugging(tiny_model, prompts_file, tmp_path):
    args = tiny_args(tiny_model, prompts_file, tmp_path / "quiet", "--num-prompts", "2")
    done = run_cli(args, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # no Lightning tip, device lines, warnings or "Loading weights" bar
    assert "labelled tokens" in done.stdout
    loud = run_cli([*tiny_args(tiny_model, prompts_file, tmp_path / "loud", "--num-prompts", "2"), "--debug"], timeout=120)
    assert loud.returncode == 0, loud.stderr
    assert "Tip:" in loud.stderr and "Loading weights" in loud.stderr, loud.stderr  # what the quiet run kept out


def test_train_keeps_third_party_noise_off_stderr(labelled, tmp_path):
    done = run_cli(["train", "fit", "--config", str(CONFIGS / "train" / "specdecpp.yaml"), "--data.path", str(labelled),
                    "--data.val_fraction", "0.4", "--data.batch_size", "4", "--trainer.default_root_dir",
                    str(tmp_path / "run"), "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                    "--trainer.max_epochs", "1"], timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # no LightningCLI args warning, tip, seed line or batch-size warnings
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
