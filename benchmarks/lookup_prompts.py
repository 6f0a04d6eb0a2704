"""Build the long-form prompts of the prompt-lookup pair (issue 71): copy-heavy and not, from text on every machine that
no one here wrote (Python's standard library source and docstrings), split into dev and confirm by source file.

    python benchmarks/lookup_prompts.py --out benchmarks/prompts     # writes lookup-{dev,confirm,fresh}.jsonl

Four families, one prompt of each per source file:
- `code-edit`: a function from the file, to be given back rewritten (type hints, a renamed variable, a docstring):
  the answer copies most of the prompt;
- `passage`: a module docstring or a class's, summarised or questioned: names and phrases come back;
- `chat-repeat`: a multi-turn chat that shows a function, is answered, and is then asked for the same function again
  with comments: the answer repeats an earlier turn;
- `open`: an open question about the module, with nothing to copy.

The file a prompt came from decides its split (a stable hash of its path), so no function, docstring or module is in
both; a third split, `fresh`, reads other files (`FRESH_SOURCES`), added once every confirm prompt had been decoded, so
that a result can be checked again on prompts no earlier run or choice saw. Prompts sharing a long run of words
(Jaccard over 8-word shingles above `--near`) are dropped before writing, and the check runs across the splits too.
The committed JSONL files are the benchmark's prompts; this script records
how they were made (the Python version whose standard library they read is in each record's `source`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

SOURCES = (
    "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "difflib.py", "heapq.py", "bisect.py", "csv.py",
    "calendar.py", "colorsys.py", "string.py", "statistics.py", "fractions.py", "gettext.py", "json/encoder.py",
    "json/decoder.py", "ipaddress.py", "pprint.py", "secrets.py", "random.py", "uuid.py", "base64.py", "quopri.py",
    "tokenize.py", "configparser.py", "netrc.py", "sched.py", "graphlib.py", "contextlib.py", "dataclasses.py",
)
"""Standard-library files present in every CPython from 3.10 on."""

FRESH_SOURCES = (
    "shutil.py", "tempfile.py", "locale.py", "operator.py", "functools.py", "enum.py", "copy.py", "weakref.py",
    "queue.py", "threading.py", "http/cookies.py", "email/utils.py", "urllib/parse.py", "html/parser.py",
    "optparse.py", "getopt.py", "codecs.py", "plistlib.py",
)
"""Other standard-library files (in every CPython from 3.10 on), all of them the `fresh` split's."""

CONFIRM_SHARE = 0.5
FUNCTION_LINES = (8, 40)
PASSAGE_CHARS = (300, 2400)
EDITS = (
    "Add type hints to every parameter and the return value of this function, keeping its body unchanged. Reply "
    "with the whole function.",
    "Rename the variable `{name}` to `{name}_value` everywhere in this function and change nothing else. Reply with "
    "the whole function.",
    "Rewrite this function with a Google-style docstring that documents its arguments and return value. Reply with "
    "the whole function.",
)
QUESTIONS = (
    "Summarise this documentation in three sentences.",
    "Which functions, classes or parameters does this passage name? List each with what the passage says about it.",
    "Rewrite this passage as a bulleted list of the facts it states, keeping the names exactly as written.",
)


def split_of(path: str) -> str:
    """The split a source file's prompts go to: a stable hash of its path, so no file is in both."""
    digest = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "confirm" if digest < CONFIRM_SHARE else "dev"


def pick(items: list, key: str) -> object:
    """A stable choice among `items`, by a hash of `key` (no global random state)."""
    return items[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(items)]


def functions(tree: ast.Module, text: str) -> list[tuple[str, str, list[str]]]:
    """(name, source, assigned variable names) of the file's top-level functions and methods of a length to edit."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
            lines = node.end_lineno - node.lineno + 1
            if FUNCTION_LINES[0] <= lines <= FUNCTION_LINES[1]:
                names = sorted({t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                                for t in n.targets if isinstance(t, ast.Name) and len(t.id) > 1})
                source = ast.get_source_segment(text, node)
                if source and names:
                    found.append((node.name, _dedent(source, node.col_offset), names))
    return found


def _dedent(source: str, offset: int) -> str:
    """A method's source moved to column 0 (its first line carries no indent in `get_source_segment`)."""
    lines = source.splitlines()
    return "\n".join([lines[0]] + [line[offset:] if line[:offset].isspace() else line for line in lines[1:]])


def passages(tree: ast.Module) -> list[str]:
    """The module's and its classes' docstrings of a length to summarise."""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    docs = [ast.get_docstring(n) for n in nodes]
    return [d for d in docs if d and PASSAGE_CHARS[0] <= len(d) <= PASSAGE_CHARS[1]]


def prompts_of(relative: str, text: str) -> list[dict]:
    """The four prompts one source file gives (fewer where it has no function or passage of a usable length)."""
    tree = ast.parse(text)
    module = relative.removesuffix(".py").replace("/", ".")
    base = {"source": f"Python {sys.version_info.major}.{sys.version_info.minor} Lib/{relative}"}
    out = []
    found = functions(tree, text)
    if found:
        name, source, names = pick(found, relative + ":edit")
        edit = pick(list(EDITS), relative + ":how").format(name=pick(names, relative + ":var"))
        out.append({**base, "category": "code-edit", "prompt": f"{edit}\n\n```python\n{source}\n```"})
        shown, shown_source, _ = pick(found, relative + ":chat")
        out.append({**base, "category": "chat-repeat", "messages": [
            {"role": "user", "content": f"What does this function from Python's `{module}` module do?\n\n"
                                        f"```python\n{shown_source}\n```"},
            {"role": "assistant", "content": f"`{shown}` is part of `{module}`. It takes the arguments shown in its "
                                             "signature and returns the result its body computes."},
            {"role": "user", "content": "Thanks. Now show me the same function again, exactly as it is, with a short "
                                        "comment above each line that says what the line does."},
        ]})
    texts = passages(tree)
    if texts:
        passage = pick(texts, relative + ":passage")
        question = pick(list(QUESTIONS), relative + ":question")
        out.append({**base, "category": "passage",
                    "prompt": f"Here is documentation from Python's `{module}` module:\n\n{passage}\n\n{question}"})
    out.append({**base, "category": "open",
                "prompt": f"When would a Python programmer reach for the standard library's `{module}` module, what "
                          "would they use instead, and what mistakes do people make with it? Answer in a few "
                          "paragraphs."})
    return out


def shingles(record: dict, width: int = 8) -> set[tuple[str, ...]]:
    """The record's 8-word shingles, over all its text."""
    text = record.get("prompt") or " ".join(m["content"] for m in record["messages"])
    words = text.split()
    return {tuple(words[i : i + width]) for i in range(max(1, len(words) - width + 1))}


def drop_near_duplicates(records: list[dict], near: float) -> tuple[list[dict], int]:
    """`records` without any that share more than `near` of their shingles (Jaccard) with an earlier kept one."""
    kept, seen, dropped = [], [], 0
    for record in records:
        mine = shingles(record)
        if any(len(mine & other) / len(mine | other) > near for other in seen):
            dropped += 1
            continue
        kept.append(record)
        seen.append(mine)
    return kept, dropped


def build(stdlib: Path, near: float) -> dict[str, list[dict]]:
    """Every source's prompts, near-duplicates dropped across the splits, with ids, by split."""
    sources = [(relative, split_of(relative)) for relative in SOURCES] + [(r, "fresh") for r in FRESH_SOURCES]
    records = []
    for relative, split in sources:
        path = stdlib / relative
        if not path.is_file():
            raise SystemExit(f"error: {path} is not in this Python's standard library; run with CPython 3.10 or newer")
        for record in prompts_of(relative, path.read_text(encoding="utf-8")):
            records.append({"split": split, **record})
    kept, dropped = drop_near_duplicates(records, near)
    print(f"{len(kept)} prompts, {dropped} near-duplicates dropped", file=sys.stderr)
    splits: dict[str, list[dict]] = {"dev": [], "confirm": [], "fresh": []}
    for record in kept:
        split = record.pop("split")
        record = {"id": f"lookup-{split}-{len(splits[split]) + 1:02d}", **record}
        splits[split].append(record)
    return splits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("prompts"))
    parser.add_argument("--near", type=float, default=0.5, help="Jaccard over 8-word shingles above which a prompt is "
                                                                "a near-duplicate of an earlier one (0-1)")
    args = parser.parse_args(argv)
    if not 0 < args.near < 1:
        parser.error(f"--near {args.near} is outside (0, 1); give a share such as 0.5")
    for split, records in build(Path(sysconfig.get_paths()["stdlib"]), args.near).items():
        target = args.out / f"lookup-{split}.jsonl"
        staged = target.with_suffix(".jsonl.tmp")
        staged.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        staged.replace(target)
        print(f"wrote {target} ({len(records)} prompts)", file=sys.stderr)


if __name__ == "__main__":
    main()
