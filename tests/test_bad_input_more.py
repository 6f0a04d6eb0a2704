"""More bad inputs, each with one line naming the problem and the fix, a non-zero exit and nothing left behind: a
shard changed in place, prompts longer than the context, output paths that cannot be written, lone surrogates, a
pickle given to --ckpt_path, empty configs, refusals that used to leave files, and the deprecated generate call."""

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_args

import specheads.eval.run
from specheads.cli import failure_line, main
from specheads.dataset.shards import read_table, shard_path
from specheads.dataset.store import MANIFEST
from specheads.plumbing.errors import UsageError

CONFIGS = Path(__file__).parents[1] / "configs" / "train"


def one_error_line(capsys, stage: str) -> str:
    """The single `specheads STAGE: error:` line of stderr (asserted to be the only one)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"specheads {stage}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train_args(data: Path, root: Path, *extra: str) -> list[str]:
    return ["train", "fit", "--config", str(CONFIGS / "specdecpp.yaml"), "--data.path", str(data), "--data.batch_size",
            "4", "--data.val_fraction", "0.4", "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1", *extra]


def eval_args(checkpoint: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--head", str(checkpoint), "--data", str(data), "--out", str(out), "--num-decode-prompts", "0",
            "--bootstrap", "5", "--progress", "false", *extra]


def checkpoint_of(root: Path) -> Path:
    return root / "specdecpp" / "checkpoints" / "last.ckpt"


# ---- MEDIUM: a shard changed in place, same size


def change_one_value_in_place(shard: Path) -> None:
    """Flip the lowest mantissa bit of the first row's stored entropies: the file keeps its size, its rows, its run
    and valid values (a positive float stays positive and finite); only its bytes differ from the recorded sha256."""
    entropy = np.asarray(read_table(shard).column("entropy")[0].as_py(), dtype=np.float32).tobytes()
    data = bytearray(shard.read_bytes())
    position = data.find(entropy)
    assert position >= 0 and data.find(entropy, position + 1) < 0
    data[position] ^= 1
    size = shard.stat().st_size
    shard.write_bytes(bytes(data))
    assert shard.stat().st_size == size


def test_a_shard_changed_in_place_is_refused_by_train_and_eval(trained, tmp_path, capsys):
    data, root = trained
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    shard = shard_path(copy, 1)
    change_one_value_in_place(shard)
    run = tmp_path / "run"
    assert main(train_args(copy, run)) == 2
    line = one_error_line(capsys, "train")
    assert f"{shard} no longer has the sha256 recorded" in line, line
    assert f"run the same `specheads gen` command again (the one that made {copy}; its options are under `config` in " \
           f"{copy / MANIFEST})" in line, line
    assert not run.exists()  # nothing of the refused run is left: no tensorboard/, config.yaml or metrics
    report = tmp_path / "report"
    assert main(eval_args(checkpoint_of(root), copy, report)) == 2
    assert f"{shard} no longer has the sha256 recorded" in one_error_line(capsys, "eval")
    assert not report.exists()


# ---- MEDIUM: eval with prompts longer than the models' context


def test_eval_skips_decode_prompts_longer_than_the_context_with_a_line(trained, tmp_path, capsys):
    data, root = trained
    prompts = tmp_path / "decode.jsonl"
    records = [{"id": "long", "query": "The quick brown fox jumps over the lazy dog. " * 60}]  # ~1 700 tokens > 256
    records += [{"id": f"short{i}", "query": f"What is {i} + {i}?"} for i in range(3)]
    prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
    report = tmp_path / "report"
    command = eval_args(checkpoint_of(root), data, report, "--decode-prompts", str(prompts), "--num-decode-prompts",
                        "2", "--max-new-tokens", "4", "--max-draft", "2", "--constant-ks", "[1]",
                        "--head-thresholds", "[0.5]")
    # a field eval's prompts lack is named with the option eval takes
    assert main(command) == 2
    line = one_error_line(capsys, "eval")
    assert f"{prompts}:1: no `messages` or `prompt`" in line and "--decode-prompts-column" in line, line
    assert "--prompts_column" not in line and not report.exists()
    assert main([*command, "--decode-prompts-column", "query"]) == 0
    printed = capsys.readouterr().out
    assert ("skipped 1 decode prompt too long for the models' context (over 252 tokens: 256 positions minus "
            "--max-new-tokens 4; first 'long'") in printed, printed
    decoding = json.loads((report / "metrics.json").read_text())["decoding"]
    assert decoding["prompts_skipped_as_too_long"] == ["long"]
    decoded = {run["prompt_id"] for run in json.loads((report / "runs.json").read_text())["runs"]}
    assert decoded == {"short0", "short1"}


# ---- LOW: output paths that cannot be written


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


def out_commands(tiny_model, prompts_file, trained, out: Path) -> dict[str, list[str]]:
    """One command per stage that takes an output folder, writing to `out`."""
    data, root = trained
    return {"gen": tiny_args(tiny_model, prompts_file, out),
            "train": train_args(data, out),
            "eval": eval_args(checkpoint_of(root), data, out),
            "export": ["export", "--ckpt", str(checkpoint_of(root)), "--out", str(out)]}


@pytest.mark.parametrize("where", ["the file itself", "under the file"])
def test_an_output_path_that_is_or_lies_under_a_file_is_named(tiny_model, prompts_file, trained, a_file, capsys,
                                                              where):
    out = a_file if where == "the file itself" else a_file / "sub"
    for stage, command in out_commands(tiny_model, prompts_file, trained, out).items():
        assert main(command) == 2, stage
        line = one_error_line(capsys, stage)
        flag = "--trainer.default_root_dir" if stage == "train" else "--out"
        expected = (f"{flag} {out} is a file, not a folder; give a folder path" if where == "the file itself"
                    else f"{flag} {out} cannot be made: {a_file} is a file, not a folder; give a path under a folder")
        assert expected in line, line
    assert a_file.read_text() == "not a folder"


def test_an_output_folder_that_cannot_be_written_is_named(tiny_model, prompts_file, trained, tmp_path, capsys,
                                                         monkeypatch):
    # the tests run as root, whom permissions do not stop: a read-only folder is simulated where the access check asks
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs:
                        False if Path(path) == read_only and mode & os.W_OK else access(path, mode, *args, **kwargs))
    out = read_only / "out"
    for stage, command in out_commands(tiny_model, prompts_file, trained, out).items():
        assert main(command) == 2, stage
        line = one_error_line(capsys, stage)
        assert f"{out} is not writable (its parent {read_only}, where it would be made)" in line, line
        assert "choose a folder you can write to" in line
    assert list(read_only.iterdir()) == []


def test_environment_errors_elsewhere_name_the_path_not_the_catch_all():
    line = failure_line(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/out/metrics.json"))
    assert line.startswith("/mnt/ro/out/metrics.json is on a read-only file system; choose an output path"), line
    line = failure_line(NotADirectoryError(errno.ENOTDIR, "Not a directory", "/data/file/sub"))
    assert "/data/file/sub has a file where a folder should be" in line and "unexpected" not in line


# ---- LOW: a lone surrogate in a prompt or response


def test_a_lone_surrogate_names_the_file_and_line(tiny_model, trained, tmp_path, capsys):
    prompts = tmp_path / "surrogate.jsonl"
    prompts.write_text('{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": "x\\ud800y"}\n')
    assert main(tiny_args(tiny_model, prompts, tmp_path / "gen")) == 2
    line = one_error_line(capsys, "gen")
    assert f"{prompts}:2: the prompt holds a lone surrogate (\\ud800 at character 2)" in line, line
    data, root = trained
    assert main(eval_args(checkpoint_of(root), data, tmp_path / "report", "--decode-prompts", str(prompts),
                          "--num-decode-prompts", "2")) == 2
    assert f"{prompts}:2: the prompt holds a lone surrogate" in one_error_line(capsys, "eval")
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"id": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}\n')
    assert main(tiny_args(tiny_model, chat, tmp_path / "gen")) == 2
    assert f"{chat}:1: the prompt holds a lone surrogate (\\udfff" in one_error_line(capsys, "gen")
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "a", "prompt": "fine"}\n')
    responses = tmp_path / "responses.jsonl"
    responses.write_text('{"id": "a", "response": "ok \\ud83d"}\n')
    assert main(tiny_args(tiny_model, good, tmp_path / "gen", "--responses", str(responses))) == 2
    assert f"{responses}:1: the response holds a lone surrogate" in one_error_line(capsys, "gen")
    assert not (tmp_path / "gen").exists() and not (tmp_path / "report").exists()


# ---- LOW: a pickle given to train's --ckpt_path


class WritesAMarker:
    """Unpickling this runs code: it writes the file it names."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_pickled_ckpt_path_is_refused_without_torchs_unsafe_advice(trained, tmp_path, capsys):
    data, _ = trained
    marker = tmp_path / "marker"
    bomb = tmp_path / "bomb.ckpt"
    torch.save({"state_dict": {}, "evil": WritesAMarker(marker)}, bomb)
    run = tmp_path / "run"
    assert main(train_args(data, run, "--ckpt_path", str(bomb))) == 2
    line = one_error_line(capsys, "train")
    assert f"refused {bomb}: it pickles Python objects" in line and "(Unsupported global: GLOBAL exec)" in line, line
    # `--ckpt_path last` names the run's newest checkpoint, checked the same way before Lightning loads it
    (run / "checkpoints").mkdir(parents=True)
    shutil.copyfile(bomb, run / "checkpoints" / "last.ckpt")
    assert main(train_args(data, run, "--ckpt_path", "last")) == 2
    last = one_error_line(capsys, "train")
    assert f"refused {run / 'checkpoints' / 'last.ckpt'}: it pickles Python objects" in last, last
    for shown in (line, last):
        for advice in ("weights_only=False", "will likely succeed", "add_safe_globals", "safe_globals", "Re-running"):
            assert advice not in shown, shown
    assert not marker.exists()
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == ["checkpoints", "checkpoints/last.ckpt"]


# ---- LOW: an empty config file


@pytest.mark.parametrize("stage", [["gen"], ["train", "fit"], ["eval"], ["export"], ["demo"]])
def test_an_empty_config_file_is_named(tmp_path, capsys, stage):
    for name, content in (("empty.yaml", ""), ("comments.yaml", "# options to come\n\n")):
        config = tmp_path / name
        config.write_text(content)
        assert main([*stage, "--config", str(config)]) == 2
        line = one_error_line(capsys, stage[0])
        assert f"--config {config} is empty (no options, only blanks or comments)" in line, line
        assert "Unexpected config" not in line


# ---- LOW: refused runs leave nothing they made


def test_a_refused_training_run_leaves_nothing_it_made(trained, tmp_path, capsys):
    data, _ = trained
    fresh = tmp_path / "fresh"
    assert main(train_args(data, fresh, "--data.batch_size", "500")) == 2  # refused in setup, after Lightning wrote
    assert "fewer than one batch" in one_error_line(capsys, "train")
    assert not fresh.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(train_args(data, kept, "--data.batch_size", "500")) == 2
    capsys.readouterr()
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_an_eval_refused_after_its_journal_opened_leaves_nothing(trained, tmp_path, capsys, monkeypatch):
    data, root = trained

    def refused(*args, **kwargs):
        raise UsageError("refused mid-sweep; the fix")

    monkeypatch.setattr(specheads.eval.run, "run_sweep", refused)
    report, existing = tmp_path / "report", tmp_path / "existing"
    existing.mkdir()
    for out in (report, existing):
        assert main(eval_args(checkpoint_of(root), data, out, "--num-decode-prompts", "2", "--max-new-tokens", "4",
                              "--constant-ks", "[1]", "--head-thresholds", "[0.5]")) == 2
        assert "refused mid-sweep" in one_error_line(capsys, "eval")
    assert not report.exists() and list(existing.iterdir()) == []  # no lock files, no runs.partial.jsonl


# ---- LOW: generate's deprecated past_key_values


def test_static_cache_responses_use_generates_current_cache_argument(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specheads.data_gen.plan import WorkItem
    from specheads.data_gen.responses import generate_responses
    from specheads.model_outputs.sampling import SamplingTransform

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    items = [WorkItem(prompt_id=f"p{i}", sample_index=0, prompt_ids=tuple(tokenizer("hello world" * (i + 1))["input_ids"]),
                      target_ratio=1.0, response_ids=None) for i in range(2)]
    transform = SamplingTransform(temperature=1.0)
    device = torch.device("cpu")
    dynamic = generate_responses(model, tokenizer, items, transform, 8, [1, 2], device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.x deprecates generate(past_key_values=...)
        static = generate_responses(model, tokenizer, items, transform, 8, [1, 2], device, cache="static")
    assert static == dynamic  # the same seeds sample the same responses
