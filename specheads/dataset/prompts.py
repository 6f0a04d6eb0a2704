"""Prompt sources: the built-in set, a JSONL file, or a Hugging Face dataset (name or local path)."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specheads.plumbing.errors import UsageError
from specheads.plumbing.hub import hub_unreachable, offline_mode, reach_fix

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).with_name("builtin_prompts.jsonl")
PROMPT_COLUMNS = ("messages", "prompt", "instruction", "question", "text")


@dataclass(frozen=True)
class Prompt:
    """One prompt as chat messages, with an id that imported responses and splits refer to."""

    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, hashable

    def as_chat(self) -> list[dict[str, str]]:
        """Messages in the form `apply_chat_template` takes."""
        return [{"role": role, "content": content} for role, content in self.messages]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles of the chat format (OpenAI's and Hugging Face chat templates'); any other is refused."""


def encodable(text: str, where: str, what: str = "the prompt") -> str:
    """`text`, refused (naming `where`) when it holds a lone surrogate: JSON's `\\ud800` escape decodes to one, but
    no tokenizer or file can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UsageError(f"{where}: {what} holds a lone surrogate (\\u{ord(text[error.start]):04x} at character "
                         f"{error.start + 1}), which is not text; fix that escape (a character beyond U+FFFF is a "
                         "high and low surrogate pair, \\ud83d\\ude00)") from None
    return text


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or OpenAI-style content parts `[{"type": "text", "text": ...}]` joined."""
    if isinstance(value, str):
        return encodable(value, where)
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in value):
        return encodable("\n".join(part["text"] for part in value), where)
    raise UsageError(f"{where}: a message's content must be text or a list of "
                     f'{{"type": "text", "text": ...}} parts, got {json.dumps(value)[:80]}; fix that message')


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise UsageError(f"{where}: the prompt is empty; give it some text")
        return (("user", encodable(value, where)),)
    if not (isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in value)):
        raise UsageError(f"{where}: expected prompt text or a list of chat messages with `role` and `content`")
    messages = []
    for message in value:
        if message["role"] not in CHAT_ROLES:
            raise UsageError(f"{where}: unknown chat role {json.dumps(message['role'])}; use one of "
                             f"{', '.join(CHAT_ROLES)}")
        messages.append((message["role"], _content(message["content"], where)))
    return tuple(messages)


def _record_to_prompt(record: Any, index: int, where: str, column: str | None, column_flag: str | None) -> Prompt:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object with `prompt` or `messages`")
    keys = (column,) if column else PROMPT_COLUMNS
    key = next((k for k in keys if k in record), None)
    if key is None:
        hint = f" (or name the field that holds the prompt with {column_flag})" if column_flag else ""
        raise UsageError(f"{where}: no {' or '.join(f'`{k}`' for k in keys)} field; add one{hint}")
    prompt_id = encodable(str(record.get("id", index)), where, "the prompt id")
    return Prompt(prompt_id, _messages(record[key], where))


def read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """Parse a JSONL file into (line number, record) pairs, naming the line of any malformed or non-UTF-8 record;
    blank lines are skipped."""
    if not path.is_file():
        raise UsageError(f"file {path} does not exist; check the path")
    records = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UsageError(f"{path}:{number}: not UTF-8 text (byte {raw[error.start]:#04x} at column "
                                 f"{error.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}:{number}: malformed JSON ({error.msg}); fix or remove that line") from error
    if not records:
        raise UsageError(f"{path} holds no records; give a JSONL file with one JSON object per line")
    return records


def _from_jsonl(path: Path, column: str | None, column_flag: str | None = None) -> list[Prompt]:
    return [_record_to_prompt(record, index, f"{path}:{line}", column, column_flag)
            for index, (line, record) in enumerate(read_jsonl(path))]


def _builtin() -> list[Prompt]:
    prompts = _from_jsonl(BUILTIN_FILE, "prompt")
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.id.rsplit("-", 1)[0], []).append(prompt)
    # round-robin over categories, so that the first N prompts cover every kind
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*by_category.values()))
    return [p for p in mixed if p is not None]


def refuse_unreachable_dataset(source: str) -> None:
    """Refuse a Hub dataset id at once when the Hub cannot be reached (`specheads.plumbing.hub`), instead of letting datasets
    retry for a minute; with HF_HUB_OFFLINE set, datasets reads its cache itself."""
    reason = hub_unreachable()
    if reason and not offline_mode():
        raise UsageError(f"cannot load prompts dataset {source!r}: it is not a local folder or file and the Hub cannot "
                         f"be reached ({reason}); {reach_fix()}, give a local folder or file, or, if it was downloaded "
                         "before, set HF_HUB_OFFLINE=1 to read the cached copy")


def _from_hf_dataset(source: str, split: str, column: str | None, column_flag: str | None) -> list[Prompt]:
    import datasets

    path = Path(source)
    try:
        if path.is_dir() and any((path / name).exists() for name in ("state.json", "dataset_dict.json")):
            data = datasets.load_from_disk(str(path))
            data = data[split] if isinstance(data, datasets.DatasetDict) else data
        elif path.is_file():
            builder = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
            if builder is None:
                raise UsageError(f"prompts file {path} has an unknown type; use .jsonl, .json, .csv or .parquet")
            data = datasets.load_dataset(builder, data_files=str(path), split=split)
        else:
            refuse_unreachable_dataset(source)
            data = datasets.load_dataset(source, split=split)
    except UsageError:
        raise
    except Exception as error:  # datasets raises many kinds (FileNotFound, ConnectionError, DatasetNotFound...)
        reason = " ".join(str(error).split())
        raise UsageError(
            f"cannot load prompts dataset {source!r} split {split!r} ({type(error).__name__}: {reason}); "
            "give a local folder or file, or check the name, split and network"
        ) from error
    return [_record_to_prompt(dict(r), i, f"{source}[{i}]", column, column_flag) for i, r in enumerate(data)]


def load_prompts(source: str, split: str = "train", column: str | None = None, limit: int | None = None,
                 column_flag: str | None = None) -> list[Prompt]:
    """Load prompts from `builtin`, a `.jsonl` file, or a datasets name/path; the first `limit` are kept.
    `column_flag` is the caller's option that names the prompt's field, suggested where a record has none."""
    if source == BUILTIN:
        prompts = _builtin()
    elif source.endswith(".jsonl"):
        prompts = _from_jsonl(Path(source), column, column_flag)
    else:
        prompts = _from_hf_dataset(source, split, column, column_flag)
    if not prompts:
        raise UsageError(f"prompt source {source!r} is empty; give at least one prompt")
    seen: set[str] = set()
    duplicates = [p.id for p in prompts if p.id in seen or seen.add(p.id)]
    if duplicates:
        raise UsageError(f"prompt ids repeat in {source!r} (first: {duplicates[0]!r}); give every prompt a unique `id`")
    return prompts[:limit] if limit else prompts


def prompt_token_limit(max_context: int, max_new_tokens: int, max_prompt_tokens: int | None = None) -> int:
    """The most tokens a prompt may have: the model's context (`max_context` positions) less the `max_new_tokens`
    generated after it, and at most `max_prompt_tokens` where given. gen and eval skip (or refuse) longer prompts: a
    model run past its context decodes garbage, and slowly."""
    limit = max_context - max_new_tokens
    return min(limit, max_prompt_tokens) if max_prompt_tokens else limit


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of the prompt with the model's chat template and the assistant turn opened."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.as_chat(), tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(content for _, content in prompt.messages))["input_ids"])


def prompt_digest(ids: Iterable[int]) -> str:
    """A short hash of a prompt's token ids (chat template applied): what identifies a prompt as the models see it,
    whatever its id or file."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()[:16]


def prompts_hash(prompts: list[Prompt]) -> str:
    """Hash of the prompt ids and texts, for the dataset fingerprint."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps([prompt.id, prompt.messages], ensure_ascii=False).encode())
    return digest.hexdigest()[:16]
