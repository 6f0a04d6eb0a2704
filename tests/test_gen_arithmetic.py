"""gen's rows and what they depend on (issue 60): the same config gives the same rows whatever torch's thread count
was when gen started; the fingerprint records the arithmetic, and data labelled under another is not resumed into;
the one-pass labeller's probe falls back, saying why, on whatever a model's layers raise."""

from __future__ import annotations

import json

import numpy as np
import torch
from conftest import tiny_args
from transformers.models.llama import modeling_llama

import specheads.data_gen.module as module
from specheads.cli import main
from specheads.data_gen.onepass import LayerCache
from specheads.data_gen.run import fingerprint_of
from specheads.dataset.store import MANIFEST, load_labelled, read_manifest


def rows(out):
    return {(r["prompt_id"], int(r["sample_index"])): r for r in load_labelled(out).with_format("numpy")}


def gen_at(threads: int, args: list[str]) -> int:
    """`specheads gen ARGS` in this process, started with torch at `threads` threads; checks that gen leaves them so."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        code = main(args)
        assert torch.get_num_threads() == threads  # gen sets its own while it labels, then gives them back
        return code
    finally:
        torch.set_num_threads(before)


def test_the_rows_do_not_depend_on_the_thread_count_gen_starts_with(tiny_model, prompts_file, tmp_path):
    """Two threads split the vocabulary's sums and the attention's reductions in another order than one, so labels
    used to differ in their last bits on every row (and a draw near a boundary could flip): gen now labels with its
    own `threads` (1 by default), and the rows are identical to the bit."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert gen_at(1, tiny_args(tiny_model, prompts_file, one, "--num-prompts", "4")) == 0
    assert gen_at(2, tiny_args(tiny_model, prompts_file, two, "--num-prompts", "4")) == 0
    a, b = rows(one), rows(two)
    assert sorted(a) == sorted(b) and len(a) == 8
    for key, row in a.items():
        for column, value in row.items():
            assert np.array_equal(np.asarray(value), np.asarray(b[key][column])), (key, column)
    manifest = read_manifest(one)
    assert manifest["fingerprint"] == read_manifest(two)["fingerprint"]
    arithmetic = manifest["identity"]["arithmetic"]
    assert arithmetic["threads"] == 1 and arithmetic["device"] == "cpu" and arithmetic["torch"] == torch.__version__
    assert arithmetic["dtype"] == "float32" and arithmetic["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_data_labelled_under_other_arithmetic_is_not_resumed_into(tiny_model, prompts_file, tmp_path, capsys):
    """A dataset whose manifest says it was labelled at two threads, with another torch, or before gen recorded its
    arithmetic is refused (one line naming what differs and the fix), its shards left as they are; `--threads` that
    matches goes on with it."""
    out = tmp_path / "data"
    args = tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2")
    assert main(args) == 0
    manifest = read_manifest(out)
    arithmetic = manifest["identity"]["arithmetic"]
    shards = {path.name: path.read_bytes() for path in (out / "shards").iterdir()}

    def made_under(record: dict | None) -> None:
        identity = {**manifest["identity"], "arithmetic": record}
        if record is None:
            del identity["arithmetic"]
        (out / MANIFEST).write_text(json.dumps({**manifest, "identity": identity, "fingerprint": fingerprint_of(identity)}))

    cases = [({**arithmetic, "threads": 2}, "under other arithmetic (threads 2 there, 1 here)", "pass --threads 2"),
             ({**arithmetic, "torch": "2.0.0"}, f"(torch 2.0.0 there, {torch.__version__} here)",
              "go on with it where it was made"),
             (None, "was labelled before gen recorded the arithmetic its rows depend on", "pass --overwrite")]
    for record, what, fix in cases:
        made_under(record)
        capsys.readouterr()
        assert main(args) == 2
        error = capsys.readouterr().err
        assert what in error and fix in error and len(error.strip().splitlines()) == 1, error
        assert {path.name: path.read_bytes() for path in (out / "shards").iterdir()} == shards
    made_under({**arithmetic, "threads": 2})
    assert main([*args, "--threads", "2"]) == 0  # the same arithmetic: finished, kept as it is
    assert read_manifest(out)["identity"]["arithmetic"]["threads"] == 2


def test_whatever_the_probe_raises_gen_falls_back_and_says_why(tiny_model, prompts_file, tmp_path, monkeypatch, capsys):
    """A family whose attention asks its cache for what the pass does not give (here a KeyError, once one of five
    exception types the probe caught, the rest escaping as a crash): gen labels with `generate` and the teacher-forced
    forwards instead, naming the error, and the rows are those of the one-pass labeller."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    assert main(tiny_args(tiny_model, prompts_file, fast, "--num-prompts", "2")) == 0
    plain = modeling_llama.LlamaAttention.forward

    def picky(self, *args, **kwargs):
        if any(isinstance(value, LayerCache) for value in (*args, *kwargs.values())):
            raise KeyError("cache_position")
        return plain(self, *args, **kwargs)

    ran, label_batch = [], module.label_batch
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", picky)
    monkeypatch.setattr(module, "label_batch", lambda *args, **kwargs: ran.append(1) or label_batch(*args, **kwargs))
    capsys.readouterr()
    assert main(tiny_args(tiny_model, prompts_file, slow, "--num-prompts", "2")) == 0
    assert ("the one-pass labeller cannot run LlamaForCausalLM (its layers raised KeyError: 'cache_position')"
            in capsys.readouterr().err)
    assert ran
    a, b = rows(fast), rows(slow)
    assert sorted(a) == sorted(b)
    for key, row in a.items():
        assert np.array_equal(row["target_ids"], b[key]["target_ids"]) and np.array_equal(row["is_draft"], b[key]["is_draft"])
        assert np.allclose(row["logp"], b[key]["logp"], atol=1e-5)
