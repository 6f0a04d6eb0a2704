"""The committed long-form prompts of the prompt-lookup pair (benchmarks/lookup_prompts.py): split by source file,
every family in every split, no near-duplicate across or within them, and the builder gives them back from this
machine's standard library where its Python is the one they were built from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"


def records(split: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / f"lookup-{split}.jsonl").read_text().splitlines()]


SPLITS = ("dev", "confirm", "fresh")


def test_no_source_file_and_no_near_duplicate_is_in_two_splits():
    builder = load_benchmark("lookup_prompts")
    splits = [records(split) for split in SPLITS]
    sources = [{r["source"] for r in split} for split in splits]
    assert all(a.isdisjoint(b) for i, a in enumerate(sources) for b in sources[i + 1:])
    for split in splits:
        assert {r["category"] for r in split} == {"code-edit", "chat-repeat", "passage", "open"}
    every = [r for split in splits for r in split]
    kept, dropped = builder.drop_near_duplicates(every, 0.5)
    assert dropped == 0 and len(kept) == len(every)
    assert len({r["id"] for r in every}) == len(every)


def test_the_near_duplicate_check_drops_a_copy_with_a_changed_word():
    builder = load_benchmark("lookup_prompts")
    first = records("confirm")[0]
    copy = {**first, "prompt": (first.get("prompt") or first["messages"][0]["content"]).replace(" the ", " a ", 1)}
    _, dropped = builder.drop_near_duplicates([first, copy], 0.5)
    assert dropped == 1


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the committed prompts were built from Python 3.11's "
                                                            "standard library")
def test_the_builder_rebuilds_the_committed_files(tmp_path):
    builder = load_benchmark("lookup_prompts")
    builder.main(["--out", str(tmp_path)])
    for split in SPLITS:
        assert (tmp_path / f"lookup-{split}.jsonl").read_text() == (PROMPTS / f"lookup-{split}.jsonl").read_text()
