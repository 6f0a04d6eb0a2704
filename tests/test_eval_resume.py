"""`specheads eval` resumes: a sweep interrupted mid-way keeps every finished batch of runs, and the re-run decodes only
the rest, giving the report an uninterrupted eval gives."""

import json
from pathlib import Path

import pytest

import specheads.eval.sweep as sweep
from specheads.cli import main
from specheads.eval.journal import JOURNAL_FILE, open_journal, read_journal
from specheads.eval.sweep import FIXED_SETTINGS, RunRecord

DECODE_RUNS = sweep.decode_runs


def eval_args(head: Path, data: Path, out: Path) -> list[str]:
    """The held-out prompts (up to 4) decoded 2 at a time under 13 settings (constant K 1, 2, 4; SVIP and confidence at
    4 thresholds each; the head at 2)."""
    return ["eval", "--head", str(head), "--data", str(data), "--out", str(out), "--num-decode-prompts", "4",
            "--max-new-tokens", "6", "--max-draft", "4", "--constant-ks", "[1,2,4]", "--head-thresholds", "[0.3,0.7]",
            "--decode-batch-size", "2", "--bootstrap", "20", "--progress", "false"]


class CountingDecoder:
    """The sweep's real `decode_runs`, recording the runs each call decodes; the call numbered `stop_at` raises
    KeyboardInterrupt before decoding, as Ctrl-C (or a scheduler's kill) would in the middle of a sweep."""

    def __init__(self, stop_at: int | None = None):
        self.stop_at, self.batches = stop_at, []

    def __call__(self, decoder, setting, prompts, *args):
        if len(self.batches) == self.stop_at:
            raise KeyboardInterrupt
        self.batches.append({(setting.policy, setting.threshold, prompt.prompt_id) for prompt in prompts})
        return DECODE_RUNS(decoder, setting, prompts, *args)


def without_wall_times(runs: list[dict]) -> list[dict]:
    return [{name: value for name, value in run.items() if not name.endswith("seconds")} for run in runs]


def test_an_interrupted_eval_resumes_without_decoding_a_finished_run_twice(trained, tmp_path, monkeypatch, capsys):
    data, root = trained
    head = root / "specdecpp" / "checkpoints" / "last.ckpt"
    whole = tmp_path / "uninterrupted"
    assert main(eval_args(head, data, whole)) == 0
    assert not (whole / JOURNAL_FILE).exists()

    out = tmp_path / "resumed"
    killed = CountingDecoder(stop_at=5)
    monkeypatch.setattr(sweep, "decode_runs", killed)
    assert main(eval_args(head, data, out)) == 130
    assert "finished work is kept; resume with: specheads eval" in capsys.readouterr().err
    assert not (out / "runs.json").exists() and len(read_journal(out / JOURNAL_FILE)[1]) == 5
    journal = out / JOURNAL_FILE  # a kill in the middle of the fifth append: that batch is not finished
    journal.write_bytes(journal.read_bytes()[:-60])
    finished = set().union(*killed.batches[:4])

    again = CountingDecoder()
    monkeypatch.setattr(sweep, "decode_runs", again)
    assert main(eval_args(head, data, out)) == 0
    decoded_again = set().union(*again.batches)
    runs = json.loads((out / "runs.json").read_text())
    every_run = {(r["policy"], r["threshold"], r["prompt_id"]) for r in runs["runs"] if r["policy"] != "oracle"}
    # K, SVIP, confidence, AdaEDL, head, vLLM's older and merged estimators and its margin revision, the history, p_min,
    # the fixed rules
    settings = 3 + 4 + 4 + 4 + 2 + 2 + 2 + 2 + 2 + 4 + len(FIXED_SETTINGS)
    assert len(every_run) == settings * len(runs["context"]["prompts"]) and len(every_run) > len(finished) > 0
    assert not decoded_again & finished and decoded_again | finished == every_run
    assert killed.batches[4] <= decoded_again  # the torn batch is decoded again
    message = f"resuming: {len(finished)} of {len(every_run)} decoding runs already finished in {journal}"
    assert message in capsys.readouterr().out
    assert not journal.exists()
    uninterrupted = json.loads((whole / "runs.json").read_text())
    assert runs["context"] == uninterrupted["context"]
    assert without_wall_times(runs["runs"]) == without_wall_times(uninterrupted["runs"])


CONTEXT = {"models": {"target": "t", "draft": "d"}, "sampling": {"temperature": 1.0}, "max_new_tokens": 6,
           "max_draft": 4, "seed": 0, "device": "cpu", "prompts": [["a", "1"], ["b", "2"]]}
HEAD = {"source": "last.ckpt", "config": {"head_type": "specdecpp_resnet", "depth": 1}, "reads": "candidate_state",
        "tau": 1.0, "draft": "d", "target": "t", "data_fingerprint": "f", "parameters": 10, "weights_digest": "w1"}


def batch(policy: str, threshold: float) -> list[RunRecord]:
    return [RunRecord(policy, threshold, prompt_id, "dev", 6, 8, 5, 2, 8, 0.1, 0.05, [3, 2], -4.0)
            for prompt_id in ("a", "b")]


def journal_with_runs(folder: Path) -> None:
    """A journal of constant K = 2 and the head at 0.5, with a third line a kill tore."""
    journal = open_journal(folder, CONTEXT, HEAD)
    journal.append(batch("constant_k", 2.0))
    journal.append(batch("head", 0.5))
    with journal.path.open("a") as handle:
        handle.write('{"runs": [{"policy": "svip", "thr')


def keys(journal) -> set[tuple[str, float, str]]:
    return set(journal.finished)


def test_the_journal_keeps_only_whole_lines_of_runs_that_would_decode_alike(tmp_path):
    journal_with_runs(tmp_path)
    journal = open_journal(tmp_path, CONTEXT, HEAD)
    assert journal.note is None and journal.finished[("head", 0.5, "b")] == batch("head", 0.5)[1]
    assert keys(journal) == {(p, t, i) for p, t in (("constant_k", 2.0), ("head", 0.5)) for i in "ab"}
    journal.append(batch("svip", 1.5))  # the torn line is gone: an append after it reads back whole
    assert [len(runs) for runs in read_journal(journal.path)[1]] == [2, 2, 2]

    journal_with_runs(tmp_path / "other-head")
    other = open_journal(tmp_path / "other-head", CONTEXT, {**HEAD, "weights_digest": "w2"})
    assert keys(other) == {("constant_k", 2.0, "a"), ("constant_k", 2.0, "b")}
    assert "another head (differs in weights_digest): keeping its head-free runs only" in other.note

    journal_with_runs(tmp_path / "moved")  # prompt "b" now sits at another position: its seed would differ
    moved = open_journal(tmp_path / "moved", {**CONTEXT, "prompts": [["a", "1"], ["c", "3"], ["b", "2"]]}, HEAD)
    assert {key[2] for key in keys(moved)} == {"a"}


@pytest.mark.parametrize("change", [{"max_new_tokens": 7}, {"seed": 1}, {"device": "cuda"}])
def test_a_journal_of_other_decoding_settings_is_discarded_in_one_line(tmp_path, change):
    journal_with_runs(tmp_path)
    journal = open_journal(tmp_path, {**CONTEXT, **change}, HEAD)
    assert not journal.finished and read_journal(journal.path)[1] == []
    assert journal.note == f"{journal.path} holds runs decoded with another {next(iter(change))}: starting afresh"
