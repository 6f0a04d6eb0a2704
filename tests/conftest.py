"""Shared fixtures: a tiny random Llama pair with its own small tokenizer, built in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach the Hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share the two cores: one thread each, and so their subprocesses
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

USER_CACHE = Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))
"""The user's own cache: the tests read its converted embedded model and write nothing else there."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts tokens with a small model.",
    "A large target model verifies the drafted tokens in one forward pass.", "def add(a, b): return a + b",
    "What is 2 + 2? It is 4.", "Summarise the text in one sentence.", "Hello! How can I help you today?",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a few sentences, with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(folder: Path, vocab_size: int = 320, layers: int = 4, seed: int = 0) -> Path:
    """Save a tiny random LlamaForCausalLM and its tokenizer to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.4, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """$SPECHEADS_CACHE for the whole session (this process and every one it starts): a temporary folder for the
    facts the tests cache, whose `models/` links to the user's, so the embedded model is converted (~30 s) only once
    and then reused."""
    root = tmp_path_factory.mktemp("specheads-cache")
    models = USER_CACHE / "models"
    models.mkdir(parents=True, exist_ok=True)
    (root / "models").symlink_to(models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECHEADS_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Folder of the tiny target; the draft is derived from it by skipping a layer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def other_tokenizer_model(tmp_path_factory) -> Path:
    """A tiny model whose tokenizer differs from `tiny_model`'s."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-other"), vocab_size=300)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    """A JSONL of 12 short prompts, half as text, half as chat messages."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = []
    for i in range(12):
        text = CORPUS[i % len(CORPUS)]
        record = {"id": f"p{i}", "prompt": text} if i % 2 else {"id": f"p{i}", "messages": [{"role": "user", "content": text}]}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    """`specheads gen` flags for a small fast run on the tiny pair."""
    return ["gen", "--target.path", str(model), "--draft.skip_layers", "[2]", "--prompts", str(prompts),
            "--samples-per-prompt", "2", "--max-new-tokens", "12", "--batch-size", "4", "--rows-per-shard", "4",
            "--out", str(out), "--progress", "false", "--accelerator", "cpu", *extra]


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m specheads ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "specheads", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def trained(tiny_model, prompts_file, tmp_path_factory):
    """A tiny labelled dataset and a SpecDec++ head and a SPRINTER verifier trained on it for one epoch."""
    from specheads.cli import main

    configs = Path(__file__).parents[1] / "configs" / "train"
    root = tmp_path_factory.mktemp("eval")
    data = root / "gen"
    assert main(tiny_args(tiny_model, prompts_file, data, "--mixing.schedule", "[0.15, 1.0]")) == 0
    for name, config in (("specdecpp", "specdecpp.yaml"), ("sprinter", "sprinter.yaml")):
        assert main(["train", "fit", "--config", str(configs / config), "--data.path", str(data),
                     "--data.val_fraction", "0.4", "--data.batch_size", "4", "--trainer.default_root_dir",
                     str(root / name), "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                     "--trainer.max_epochs", "1"]) == 0
    return data, root


def vocabulary_maps(size: int, step: int) -> tuple[list[int], list[bool]]:
    """(d2t, t2d) of a draft vocabulary of every `step`-th target token, as a feature drafter's maps."""
    kept = list(range(0, size, step))
    return [t - i for i, t in enumerate(kept)], [i in set(kept) for i in range(size)]


def target_greedy(target, prompt: list[int], count: int) -> list[int]:
    """The `count` tokens transformers' greedy generation gives after `prompt` (no stop token): what an exact decoder
    must give at temperature 0."""
    import torch

    ids = torch.tensor([prompt])
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def random_token_head(folder: Path, draft_kind: str = "lookup", seed: int = 0) -> str:
    """A token-only stop head with random weights for `draft_kind`, exported as `specheads train lookup fit` exports
    one: its folder."""
    import torch

    from specheads.heads.lookup import TokenHeadModel

    torch.manual_seed(seed)
    return str(TokenHeadModel("lookup_token_stop", width=16, depth=1, draft_kind=draft_kind).export(folder))


def load_benchmark(name: str):
    """The module benchmarks/NAME.py (the benchmarks are scripts, not a package), registered under its file's name so
    that its dataclasses resolve."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
