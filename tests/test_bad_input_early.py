"""Bad input refused before the work: every eval, profile and output-path input that can be checked is checked
before any model loads or any forward runs (issue 60), in one line naming the problem and the fix, exit 2, nothing
written; output paths that exist and are not regular files (or folders) are never replaced."""

import builtins
import hashlib
import io
import json
import os
import stat
from pathlib import Path

import pytest
from conftest import tiny_args
from test_bad_input_more import checkpoint_of, eval_args, one_error_line

import specheads.eval.run
from specheads.cli import main
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

PRESET = "h100-llama3.1-8b-llama3.2-1b"


def refused(capsys, stage: str, args: list[str], *fragments: str) -> str:
    """Run, expect exit 2 and one error line holding every fragment; return it."""
    assert main(args) == 2
    line = one_error_line(capsys, stage)
    for fragment in fragments:
        assert fragment in line, line
    return line


# ---- eval: the options checked from the flags alone, before the head or the data is read


@pytest.mark.parametrize("flags, fragments", [
    (["--serving-batch-sizes", "[1]", "--serving-costs", "[]"], ["--serving-costs is empty", "drop it"]),
    (["--serving-batch-sizes", "[]"], ["--serving-batch-sizes is empty", "[1, 8]"]),
    (["--serving-batch-sizes", "[2, 1, 2]"], ["gives a batch size twice"]),
    (["--serving-costs", "measured"], ["--serving-costs is for the serving table, but no batch size is served",
                                       "give --serving-batch-sizes"]),
    (["--budget-head", "expected.ckpt"], ["--budget-head is for the serving table"]),
    (["--serving-batch-sizes", "[1, 4]"], ["--serving-batch-sizes 4 is more than the at most 3 test requests",
                                          "raise --test-samples"]),
    (["--fixed-thresholds", "{}"], ["--fixed-thresholds is empty", "drop it to tune on dev prompts"]),
    (["--fixed-thresholds", '{"head": 0.6, "head_cost": 0.3}'], ["gives head_cost", "--cost-ratio"]),
    (["--test-samples", "1000000000000"], ["--test-samples 1000000000000 is above 1,000", "give at most 1,000"]),
    (["--bootstrap", "1000000000000"], ["--bootstrap 1000000000000 is above 100,000"]),
    (["--tree-budgets", "[8, 100000]"], ["--tree-budgets 100000 is above 1,024"]),
    (["--max-draft", "100000"], ["--max-draft 100000 is above 256"]),
])
def test_eval_options_that_cannot_work_are_refused_from_the_flags(tmp_path, capsys, flags, fragments):
    out = tmp_path / "out"
    refused(capsys, "eval", ["eval", "--head", str(tmp_path / "no-head"), "--data", str(tmp_path / "no-data"), "--out",
                             str(out), "--num-decode-prompts", "6", *flags], *fragments)
    assert not out.exists()


def test_head_cost_is_not_offered_where_it_cannot_be_given():
    from specheads.eval.tuned import given_tuning

    with pytest.raises(UsageError) as error:
        given_tuning({"head": 0.5, "sprinter": 0.5}, "head", 8)
    assert "sprinter" in str(error.value) and "head_cost" not in str(error.value)


# ---- eval: the checks that need the head but no model run before any model loads


@pytest.fixture
def no_models(monkeypatch):
    """Loading the models fails the test: whatever is refused here is refused before."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(specheads.eval.run, "load_pair", loaded)


def test_a_wrong_budget_head_is_refused_before_any_model_loads(trained, tmp_path, capsys, no_models):
    data, root = trained
    out = tmp_path / "report"
    decode = ["--num-decode-prompts", "6", "--serving-batch-sizes", "[1]"]
    refused(capsys, "eval", eval_args(checkpoint_of(root), data, out, *decode, "--budget-head",
                                      str(root / "sprinter" / "checkpoints" / "last.ckpt")),
            "--budget-head", "--budget-head takes an expected-acceptance head")
    refused(capsys, "eval", eval_args(checkpoint_of(root), data, out, *decode, "--budget-head", str(tmp_path / "none")))
    assert not out.exists()


def test_given_thresholds_this_eval_cannot_decode_are_refused_before_any_model_loads(trained, tmp_path, capsys,
                                                                                   no_models):
    data, root = trained
    out = tmp_path / "report"
    given = ["--num-decode-prompts", "2", "--fixed-thresholds"]
    refused(capsys, "eval", eval_args(checkpoint_of(root), data, out, *given, '{"head": 0.5, "sv_companion": 0.5}'),
            "names SV's companion rule; give --sv-companion-skip-layers")
    refused(capsys, "eval", eval_args(checkpoint_of(root), data, out, *given, '{"head": 0.5, "constant_k": 2}',
                                      "--tree-budgets", "[2]"),
            "--fixed-thresholds has no floor for the confidence-valued tree at N = 2")
    assert not out.exists()


def test_cost_tables_are_noted_when_they_shadow_a_preset_or_were_measured_for_other_models(trained, tmp_path, capsys,
                                                                                          monkeypatch):
    def stop(*args, **kwargs):
        raise UsageError("stopped where the models would load")

    monkeypatch.setattr(specheads.eval.run, "load_pair", stop)
    monkeypatch.chdir(tmp_path)
    curve = {"tokens": [1, 2], "seconds": [0.01, 0.02]}
    Path(PRESET).write_text(json.dumps({"source": "measured", "draft": curve, "target": curve, "models": {
        "draft": {"name": "some-1b"}, "target": {"name": "some-8b"}}}))
    data, root = trained
    assert main(eval_args(checkpoint_of(root), data, tmp_path / "report", "--num-decode-prompts", "2",
                          "--fixed-thresholds", '{"head": 0.5}', "--serving-batch-sizes", "[1]", "--serving-costs",
                          PRESET)) == 2
    printed, err = capsys.readouterr()
    assert "stopped where the models would load" in err
    assert f"note: --serving-costs {PRESET} reads the file {tmp_path / PRESET}, which shadows the roofline preset" in printed
    assert "was measured for another target 'some-8b' (this pair's: " in printed
    assert "and draft 'some-1b' (this pair's: 'target minus layers 2'); its curves price this pair's rounds as they are" in printed


def test_batch_sizes_the_found_test_requests_cannot_fill_are_refused_before_any_forward(trained, tmp_path, capsys,
                                                                                       monkeypatch):
    def forward(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(specheads.eval.run, "collect_tokens", forward)
    prompts = tmp_path / "fresh.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"f{i}", "prompt": f"Tell me about the number {i}."}) + "\n"
                               for i in range(4)))
    data, root = trained
    out = tmp_path / "report"  # 8 asked, 4 found: 2 of them test prompts, not the 4 the flags allow
    refused(capsys, "eval", eval_args(checkpoint_of(root), data, out, "--decode-prompts", str(prompts),
                                      "--num-decode-prompts", "8", "--serving-batch-sizes", "[1, 4]"),
            "--serving-batch-sizes 4 is more than the 2 test requests found to decode")
    assert not out.exists()


def opened_files(monkeypatch) -> list[Path]:
    """The files opened from now on (`open`, `io.open` and so every `Path` read), in order."""
    opened: list[Path] = []
    real = io.open

    def counted(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            opened.append(Path(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counted)
    monkeypatch.setattr(builtins, "open", counted)
    return opened


def digested_heads(monkeypatch) -> list[int]:
    """The heads whose weights are digested from now on (`weights_digest`), by id, once per digest."""
    from specheads.heads.base import AcceptanceHead

    digested: list[int] = []
    real = AcceptanceHead.weights_digest
    monkeypatch.setattr(AcceptanceHead, "weights_digest", lambda head: digested.append(id(head)) or real(head))
    return digested


def test_the_report_keeps_the_table_file_and_the_curve_points_it_priced_with_not_the_whole_table(trained, tmp_path,
                                                                                                 capsys, monkeypatch):
    points = range(1, 20_001)
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"draft": {"tokens": list(points), "seconds": [1e-3 + 1e-6 * n for n in points]},
                                 "target": {"tokens": list(points), "seconds": [5e-3 + 1e-6 * n for n in points]}}))
    data, root = trained
    out = tmp_path / "report"
    opened, digested = opened_files(monkeypatch), digested_heads(monkeypatch)
    assert main(eval_args(checkpoint_of(root), data, out, "--num-decode-prompts", "2", "--max-new-tokens", "4",
                          "--max-draft", "3", "--fixed-thresholds", '{"head": 0.5, "constant_k": 2}',
                          "--serving-batch-sizes", "[1]", "--serving-batch-policies", "[]",
                          "--serving-costs", str(table))) == 0
    monkeypatch.undo()
    # the table is read once (checked, noted, priced with and hashed from those bytes), the head digested once
    assert opened.count(table) == 1, opened.count(table)
    assert len(digested) == 1, digested
    curves = json.loads((out / "metrics.json").read_text())["decoding"]["serving"]["cost_curves"]["given"]
    assert (curves["path"], curves["sha256"]) == (str(table), hashlib.sha256(table.read_bytes()).hexdigest())
    # one request of at most 4 tokens a forward (K_max 3 and a bonus, or 4 new tokens and one): points 1 .. 5
    for role, start in (("draft", 1e-3), ("target", 5e-3)):
        assert curves[role]["tokens"] == [1, 2, 3, 4, 5] and curves[role]["points_in_table"] == 20_000
        assert curves[role]["seconds"] == pytest.approx([start + 1e-6 * n for n in range(1, 6)])
    assert (out / "metrics.json").stat().st_size < table.stat().st_size / 4


# ---- output paths: anything there that is not a regular file (or a folder, where one is meant) is refused


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_profile_out_never_replaces_a_fifo_or_a_symbolic_link(tmp_path, capsys, fifo):
    preset = ["profile", "--preset", PRESET, "--out"]
    refused(capsys, "profile", [*preset, str(fifo)], f"--out {fifo} is a FIFO (named pipe), not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    kept = tmp_path / "kept.json"
    kept.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    refused(capsys, "profile", [*preset, str(link)], f"--out {link} is a symbolic link, not a regular file")
    assert link.is_symlink() and kept.read_text() == "mine"


def test_profile_out_in_a_folder_that_takes_no_files_names_it(capsys):
    refused(capsys, "profile", ["profile", "--preset", PRESET, "--out", "/proc/specheads-costs.json"],
            "--out's folder /proc is not writable: making a file there failed", "choose a folder you can write to")


@pytest.mark.parametrize("flags, fragment", [
    (["--contexts", "[200000]"], "--contexts 200000 is above 131,071: cached tokens per row, and the preset's models"),
    (["--tokens", "[1, 10000000]"], "--tokens 10000000 is above 65,536"),
    (["--batch-size", "10000000"], "--batch-size 10000000 is above 65,536"),
])
def test_absurd_preset_counts_are_refused(tmp_path, capsys, flags, fragment):
    out = tmp_path / "costs.json"
    refused(capsys, "profile", ["profile", "--preset", PRESET, *flags, "--out", str(out)], fragment)
    assert not out.exists()


def test_eval_refuses_a_report_folder_whose_files_are_not_regular_files(tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    os.mkfifo(out / "metrics.json")
    refused(capsys, "eval", ["eval", "--head", str(tmp_path / "h"), "--data", str(tmp_path / "d"), "--out", str(out)],
            f"--out {out} holds metrics.json as a FIFO (named pipe), not a regular file")
    assert stat.S_ISFIFO(os.lstat(out / "metrics.json").st_mode)


def test_gen_and_export_refuse_an_out_that_is_not_a_folder_or_is_a_link_replaced(tiny_model, prompts_file, tmp_path,
                                                                                capsys, fifo):
    refused(capsys, "gen", tiny_args(tiny_model, prompts_file, fifo), f"--out {fifo} is a FIFO (named pipe), not a folder")
    folder = tmp_path / "mine"
    folder.mkdir()
    link = tmp_path / "head-link"
    link.symlink_to(folder, target_is_directory=True)
    refused(capsys, "export", ["export", "--ckpt", str(tmp_path / "no.ckpt"), "--out", str(link)],
            f"--out {link} is a symbolic link, which the new folder would replace")
    assert link.is_symlink()


def test_every_atomic_write_refuses_to_replace_what_is_not_a_regular_file(fifo):
    with pytest.raises(UsageError, match="is a FIFO"):
        write_json_atomic(fifo, {"a": 1})
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ---- the demo's own eval commands pass these checks


@pytest.mark.parametrize("size", ["quick", "full"])
def test_the_demos_eval_commands_are_valid(size, tmp_path):
    from specheads.demo.stages import EVALUATED, Layout, eval_stage, shipped_eval_stage
    from specheads.eval.cli import parse_config

    layout = Layout(tmp_path)
    layout.report("ontime").mkdir(parents=True)
    (layout.report("ontime") / "runs.json").write_text("{}")  # the verifier's eval takes the on-time eval's runs
    for stage in [*(eval_stage(layout, size, head, False) for head in EVALUATED), shipped_eval_stage(layout, size, False)]:
        parse_config(list(stage.argv[1:])).validate()


# ---- the stage packages say what they do


@pytest.mark.parametrize("package", ["specheads.eval", "specheads.train"])
def test_a_stage_package_docstring_says_what_it_does(package):
    import importlib

    text = importlib.import_module(package).__doc__
    assert "see its issue" not in text and f"`specheads {package.split('.')[1]}" in text


# ---- gen: counts that allocate in proportion, refused before anything loads or is written


@pytest.mark.parametrize("flag, value", [("--samples-per-prompt", "1000000000000"), ("--batch-size", "100000000"),
                                         ("--threads", "100000")])
def test_gen_counts_beyond_their_bounds_are_refused_before_any_model_loads(tmp_path, capsys, monkeypatch, flag, value):
    import specheads.data_gen.run

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(specheads.data_gen.run, "load_pair", loaded, raising=False)
    out = tmp_path / "gen"
    extra = ["--rows-per-shard", value] if flag == "--batch-size" else []  # a shard holds whole batches
    refused(capsys, "gen", ["gen", "--config", "smollm2-demo", flag, value, *extra, "--out", str(out)],
            f"--{flag[2:].replace('-', '_')} {value} is above", "give at most")
    assert not out.exists()
