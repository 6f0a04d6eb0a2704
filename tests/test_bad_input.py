"""Every bad input gets one clear error line, a non-zero exit, and nothing written."""

import json
import time

import pytest
from conftest import tiny_args

from specheads.cli import main
from specheads.dataset.store import load_labelled, read_manifest


def fails(capsys, args, *expected):
    """Run, expect exit 2 and exactly one error line holding every `expected` fragment; return that line."""
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specheads gen: error:")]
    assert len(lines) == 1 and "UsageError" not in err, err  # no traceback of ours
    for fragment in expected:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_tokenizer_mismatch_names_both_models(capsys, tiny_model, other_tokenizer_model, prompts_file, tmp_path):
    out = tmp_path / "out"
    fails(capsys, tiny_args(tiny_model, prompts_file, out, "--draft.path", str(other_tokenizer_model)),
          "different tokenizers", str(tiny_model), str(other_tokenizer_model))
    assert not out.exists()


def test_missing_and_empty_prompt_files(capsys, tiny_model, tmp_path):
    out = tmp_path / "out"
    fails(capsys, tiny_args(tiny_model, tmp_path / "nope.jsonl", out), "does not exist")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    fails(capsys, tiny_args(tiny_model, empty, out), "holds no records")
    assert not out.exists()


def test_malformed_jsonl_line_is_named(capsys, tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "ok"}\n{"id": "c", "prompt": \n')
    fails(capsys, tiny_args(tiny_model, bad, tmp_path / "out"), f"{bad}:3", "malformed JSON")
    gaps = tmp_path / "gaps.jsonl"  # blank lines count: the error names the file's own line number
    gaps.write_text('{"id": "a", "prompt": "hi"}\n\n\n{"id": "b", "messages": [{"role": "hacker", "content": "x"}]}\n')
    fails(capsys, tiny_args(tiny_model, gaps, tmp_path / "out"), f"{gaps}:4", "unknown chat role")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"id": "a", "text_x": "hi"}\n')
    fails(capsys, tiny_args(tiny_model, no_field, tmp_path / "out"), f"{no_field}:1")
    assert not (tmp_path / "out").exists()


def test_unknown_model_id_without_network(capsys, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = fails(capsys, tiny_args("no-such-org/no-such-model", prompts_file, tmp_path / "out"),
                 "cannot load model 'no-such-org/no-such-model'", "(HF_HUB_OFFLINE is set)")
    assert line.endswith("unset HF_HUB_OFFLINE where there is a network, or pass a local folder or .gguf file"), line
    fails(capsys, tiny_args(tmp_path / "missing-folder", prompts_file, tmp_path / "out"), "does not exist")
    assert not (tmp_path / "out").exists()


def test_hub_dataset_without_network_is_refused_at_once(capsys, tiny_model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a Hub nothing answers for: no network
    started = time.monotonic()
    line = fails(capsys, tiny_args(tiny_model, "no-such-org/no-such-dataset", tmp_path / "out"),
                 "cannot load prompts dataset 'no-such-org/no-such-dataset'", "no connection to 127.0.0.1")
    assert line.endswith("set HF_HUB_OFFLINE=1 to read the cached copy"), line
    assert time.monotonic() - started < 10
    assert not (tmp_path / "out").exists()


def test_output_with_other_fingerprint_is_refused_unless_overwrite(capsys, tiny_model, prompts_file, tmp_path):
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2")) == 0
    before = read_manifest(out)
    fails(capsys, tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2", "--seed", "5"),
          "different fingerprint", "seed", "--overwrite")
    assert read_manifest(out) == before
    assert main(tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2")) == 0  # same run: nothing to redo
    assert "nothing new to label" in capsys.readouterr().out
    assert main(tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2", "--seed", "5", "--overwrite")) == 0
    assert read_manifest(out)["identity"]["seed"] == 5
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    fails(capsys, tiny_args(tiny_model, prompts_file, stranger), "not empty", "--overwrite")


def test_long_prompts_are_skipped_and_counted_or_fail(capsys, tiny_model, tmp_path):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": "word " * (3 if i % 2 else 80)}) for i in range(6)))
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model, prompts, out, "--max-prompt-tokens", "40")) == 0
    manifest = read_manifest(out)
    assert manifest["counts"]["skipped_prompts"] == 3 and manifest["skipped_prompt_ids"] == ["q0", "q2", "q4"]
    assert set(load_labelled(out)["prompt_id"]) == {"q1", "q3", "q5"}
    printed = capsys.readouterr().out
    assert "skipped 3 prompts too long for the context" in printed and "skipped_prompt_ids" in printed
    assert main(tiny_args(tiny_model, prompts, out, "--max-prompt-tokens", "40")) == 0  # a finished run says it again
    assert "skipped 3 prompts" in capsys.readouterr().out
    fails(capsys, tiny_args(tiny_model, prompts, tmp_path / "out2", "--max-prompt-tokens", "40", "--long-prompts", "fail"),
          "prompt 'q0'", "long_prompts: skip")
    assert not (tmp_path / "out2").exists()
    # the model's own context (256 positions) is a limit too
    fails(capsys, tiny_args(tiny_model, prompts, tmp_path / "out3", "--max-new-tokens", "250", "--long-prompts", "fail"),
          "context 256")


def test_imported_responses(capsys, tiny_model, prompts_file, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    responses = tmp_path / "responses.jsonl"
    ids = tokenizer("It is 4.", add_special_tokens=False)["input_ids"]
    responses.write_text("\n".join([
        json.dumps({"id": "p0", "response": "The quick brown fox."}),
        json.dumps({"id": "p0", "response": "A large model", "finish_reason": "length"}),
        json.dumps({"id": "p1", "response_ids": ids}),
        json.dumps({"id": "p1", "response_ids": (ids * 20)[:50]}),  # longer than --max-new-tokens 40: cut and counted
    ]) + "\n")
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model, prompts_file, out, "--responses", str(responses), "--num-prompts", "3",
                     "--max-new-tokens", "40")) == 0
    rows = {(r["prompt_id"], r["sample_index"]): r for r in load_labelled(out)}
    assert sorted(rows) == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
    assert rows[("p1", 1)]["target_ids"] == (ids * 20)[:40]
    # p2 has no response and one response was cut: both are counted in the manifest, the card and the summary
    manifest = read_manifest(out)
    assert manifest["counts"]["prompts"] == 2 and manifest["counts"]["unanswered_prompts"] == 1
    assert manifest["unanswered_prompt_ids"] == ["p2"] and manifest["counts"]["truncated_responses"] == 1
    card = (out / "README.md").read_text()
    assert "| prompts labelled | 2 (left out as too long: 0; without an imported response: 1) |" in card
    assert "| imported responses cut at max_new_tokens | 1 |" in card
    printed = capsys.readouterr().out
    assert "left out 1 prompt with no imported response" in printed and "cut 1 imported response longer" in printed
    expected = tokenizer("The quick brown fox.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert rows[("p0", 0)]["target_ids"] == expected
    assert rows[("p0", 1)]["target_ids"] == tokenizer("A large model", add_special_tokens=False)["input_ids"]
    assert rows[("p1", 0)]["target_ids"] == ids
    assert read_manifest(out)["identity"]["responses"]["source"] == "imported"

    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"id": "zzz", "response": "hi"}) + "\n")
    fails(capsys, tiny_args(tiny_model, prompts_file, tmp_path / "out2", "--responses", str(unknown)),
          "not in the prompt set", "'zzz'")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("flags,fragment", [
    (["--samples-per-prompt", "0"], "--samples-per-prompt: 0 is not a PositiveInt (v>0)"),
    (["--rows-per-shard", "6"], "multiple of batch_size"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "0"], "every sample of a prompt is the same greedy response"),
    (["--mixing.schedule", "[0.5, 2.0]"], "--mixing.schedule: 2.0 is not a ClosedUnitInterval (v>=0 and v<=1)"),
    (["--no-such-flag", "1"], "--no-such-flag"),
])
def test_bad_settings(capsys, tiny_model, prompts_file, tmp_path, flags, fragment):
    fails(capsys, tiny_args(tiny_model, prompts_file, tmp_path / "out", *flags), fragment)
    assert not (tmp_path / "out").exists()


def test_unknown_subcommand(capsys):
    assert main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err


def no_traceback_of_ours(err: str) -> bool:
    """No traceback but those Python's logging prints when a third-party handler writes to a stream an earlier
    test's capture closed ("--- Logging error ---", one traceback each)."""
    return err.count("Traceback (most recent call last)") == err.count("--- Logging error ---")


def test_a_full_disk_and_an_unexpected_error_end_in_one_line_unless_debugging(capsys, tiny_model, prompts_file,
                                                                            tmp_path, monkeypatch):
    import errno

    import specheads.data_gen.module
    def disk_full(out, index, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / f"shard-{index:05d}.arrow"))

    monkeypatch.setattr(specheads.data_gen.module, "write_shard", disk_full)
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model, prompts_file, out, "--num-prompts", "2")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specheads gen: error:")]
    assert len(lines) == 1 and no_traceback_of_ours(err), err
    assert "the disk is full writing" in lines[0] and "run the same command again" in lines[0]
    with pytest.raises(OSError):  # the traceback is there for whoever asks
        main(["--debug", *tiny_args(tiny_model, prompts_file, tmp_path / "again", "--num-prompts", "2")])
    monkeypatch.setenv("SPECHEADS_DEBUG", "1")
    with pytest.raises(OSError):
        main(tiny_args(tiny_model, prompts_file, tmp_path / "again", "--num-prompts", "2"))
    monkeypatch.delenv("SPECHEADS_DEBUG")

    def broken(*args, **kwargs):
        raise RuntimeError("something nobody foresaw\nsecond line")

    monkeypatch.setattr(specheads.data_gen.module, "write_shard", broken)
    assert main(tiny_args(tiny_model, prompts_file, tmp_path / "third", "--num-prompts", "2")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specheads gen: error:")]
    assert len(lines) == 1 and no_traceback_of_ours(err), err
    assert "unexpected RuntimeError: something nobody foresaw second line" in lines[0] and "SPECHEADS_DEBUG=1" in lines[0]


def test_non_utf8_prompts_and_responses_name_the_file_and_line(capsys, tiny_model, prompts_file, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    fails(capsys, tiny_args(tiny_model, bad, tmp_path / "out"), f"{bad}:2", "not UTF-8", "0xe9", "save the file as UTF-8")
    responses = tmp_path / "responses.jsonl"
    responses.write_bytes(b'{"id": "p0", "response": "\xff\xfe"}\n')
    fails(capsys, tiny_args(tiny_model, prompts_file, tmp_path / "out", "--responses", str(responses)),
          f"{responses}:1", "not UTF-8")
    assert not (tmp_path / "out").exists()


def test_response_ids_must_be_integers_not_booleans(capsys, tiny_model, prompts_file, tmp_path):
    for ids in ([True, 100, 2], [1.0, 2], ["5"]):
        responses = tmp_path / "responses.jsonl"
        responses.write_text(json.dumps({"id": "p0", "response_ids": ids}) + "\n")
        fails(capsys, tiny_args(tiny_model, prompts_file, tmp_path / "out", "--responses", str(responses)),
              f"{responses}:1", "integer token ids")
        assert not (tmp_path / "out").exists()  # refused before any compute or write


def test_chat_messages_accept_content_parts_and_refuse_unknown_roles_and_nulls(capsys, tiny_model, tmp_path):
    from specheads.dataset.prompts import load_prompts

    good = tmp_path / "parts.jsonl"
    good.write_text(json.dumps({"id": "a", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]}) + "\n")
    assert load_prompts(str(good))[0].messages == (("system", "Be brief."), ("user", "Hello\nthere"))
    for number, (message, fragment) in enumerate([
            ({"role": "hacker", "content": "hi"}, 'unknown chat role "hacker"'),
            ({"role": None, "content": "hi"}, "unknown chat role null"),
            ({"role": "user", "content": None}, "content must be text"),
            ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "content must be text")]):
        bad = tmp_path / f"bad{number}.jsonl"
        bad.write_text(json.dumps({"id": "ok", "prompt": "fine"}) + "\n" + json.dumps({"id": "b", "messages": [message]}) + "\n")
        fails(capsys, tiny_args(tiny_model, bad, tmp_path / "out"), f"{bad}:2", fragment)
        assert not (tmp_path / "out").exists()
