"""`specheads export` stays inside its folders: index names outside the checkpoint, links and special files, an
`--out` that holds an input, a head of another drafter, non-finite or unstorable heads are refused in one line before
anything is written; two exports into one folder never both write; an interrupted export leaves nothing behind."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dspark_export import build_checkpoint, export, head_checkpoint, labelled_by, random_head

from specheads.cli import main
from specheads.export.dspark import WEIGHT
from specheads.heads import build_head

pytest.importorskip("speculators.models.dspark")
HIDDEN = 16


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("dspark-sharded") / "drafter", confidence_head=False, shard="4KB")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("dspark-single") / "drafter")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes (links not followed)."""
    return {str(p.relative_to(folder)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def refused(code: int, capsys, *phrases: str) -> str:
    """The one-line refusal (exit 2) that names `phrases`."""
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1, error
    for phrase in phrases:
        assert phrase in error, error
    return error


def nothing_written(tmp_path: Path, out: Path) -> None:
    assert not out.exists() and not [p for p in tmp_path.rglob(".*") if not p.name.startswith(".specheads")]


@pytest.mark.parametrize("name", ["../victim/model-00001-of-00002.safetensors", "ABSOLUTE", "linked"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path, capsys, name):
    source, victim = tmp_path / "drafter", tmp_path / "victim"
    shutil.copytree(sharded, source)
    shutil.copytree(sharded, victim)
    index_path = source / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    if name == "ABSOLUTE":
        name = str(victim / first)
    elif name == "linked":
        (source / "linked").symlink_to(victim / first)
    index["weight_map"] = {key: (name if shard == first else shard) for key, shard in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    before = snapshot(victim)
    code, out = export(tmp_path, random_head(markov_rank=0), source)
    refused(code, capsys, "--into-dspark" if name == "linked" else "model.safetensors.index.json")
    assert snapshot(victim) == before  # the other drafter's weights never receive our head
    nothing_written(tmp_path, out)


def test_a_head_of_another_drafter_or_of_a_draft_models_states_is_refused(single, tmp_path, capsys):
    other = build_checkpoint(tmp_path / "other", confidence_head=True)
    save_file({**load_file(other / "model.safetensors"), "norm.weight": torch.full((HIDDEN,), 2.0)},
              other / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # the saving's progress bar
    skip_layer = {"draft": {"name": "target minus layers 2", "state_layer": None,
                            "weights": {"derived_from_target": True, "skip_layers": [2]}}}
    for identity, phrase in ((labelled_by(other), "not by the DSpark drafter in"),
                             (skip_layer, "target minus layers 2"),
                             ({}, "records no drafter")):
        code, out = export(tmp_path, random_head(), single, identity=identity)
        refused(code, capsys, phrase)
        nothing_written(tmp_path, out)


def test_a_folder_export_wrote_takes_a_head_of_its_drafter_again_but_not_once_changed(single, tmp_path, capsys):
    first = tmp_path / "first"
    first.mkdir()
    code, written = export(first, random_head(), single)
    assert code == 0
    code, out = export(tmp_path, random_head(), written, identity=labelled_by(single))
    assert code == 0 and (out / "model.safetensors").is_file()
    tensors = load_file(written / "model.safetensors")
    save_file({**tensors, "norm.weight": tensors["norm.weight"] * 2}, written / "model.safetensors",
              metadata={"format": "pt"})
    shutil.rmtree(out)
    capsys.readouterr()
    code, out = export(tmp_path, random_head(), written, identity=labelled_by(single))
    refused(code, capsys, "not by the DSpark drafter in")
    assert not out.exists()


def test_non_finite_heads_are_refused_as_they_would_be_stored(single, tmp_path, capsys):
    zero_std = random_head()
    with torch.no_grad():
        zero_std.hidden_std[3] = 0.0
    code, out = export(tmp_path, zero_std, single)
    refused(code, capsys, "NaN or infinite")
    nothing_written(tmp_path, out)
    half = tmp_path / "half"
    shutil.copytree(single, half)
    save_file({k: t.half() for k, t in load_file(half / "model.safetensors").items()}, half / "model.safetensors",
              metadata={"format": "pt"})
    large = random_head()
    with torch.no_grad():
        large.out.weight.mul_(1e6)  # finite in float32, infinite in float16
    code, out = export(tmp_path, large, half)
    refused(code, capsys, "NaN or infinite")
    nothing_written(tmp_path, out)


def test_an_unknown_checkpoint_dtype_is_refused_not_taken_as_float32(single, tmp_path, capsys):
    source = tmp_path / "int8"
    shutil.copytree(single, source)
    tensors = load_file(source / "model.safetensors")
    save_file({**tensors, WEIGHT: tensors[WEIGHT].to(torch.int8)}, source / "model.safetensors",
              metadata={"format": "pt"})
    code, out = export(tmp_path, random_head(), source)
    refused(code, capsys, "I8")
    nothing_written(tmp_path, out)


@pytest.mark.parametrize("kind", ["folder link", "file link", "fifo"])
def test_links_and_special_files_in_the_checkpoint_are_refused(single, tmp_path, capsys, kind):
    source, outside = tmp_path / "drafter", tmp_path / "outside"
    shutil.copytree(single, source)
    outside.mkdir()
    (outside / "secret.txt").write_text("not to be published")
    if kind == "folder link":
        (source / "extra").symlink_to(outside)
    elif kind == "file link":
        (source / "notes.txt").symlink_to(outside / "secret.txt")
    else:
        os.mkfifo(source / "pipe")
    code, out = export(tmp_path, random_head(), source)
    refused(code, capsys, "--into-dspark", "cp -rL")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_an_out_that_is_or_holds_the_input_is_refused_even_with_overwrite(single, tmp_path, capsys):
    parent = tmp_path / "drafters"
    source = parent / "drafter"
    shutil.copytree(single, source)
    (parent / "sibling.txt").write_text("a sibling")
    before = snapshot(parent)
    checkpoint = head_checkpoint(tmp_path / "head.ckpt", random_head(), labelled_by(source))
    for out in (source, parent):
        code = main(["export", "--ckpt", str(checkpoint), "--into-dspark", str(source), "--out", str(out),
                     "--overwrite"])
        refused(code, capsys, "the input --into-dspark")
        assert snapshot(parent) == before
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    chain = head_checkpoint(run / "checkpoints" / "last.ckpt", build_head("specdecpp_resnet", hidden_size=HIDDEN))
    for out in (run, run / "checkpoints"):
        code = main(["export", "--ckpt", str(chain), "--out", str(out), "--overwrite"])
        refused(code, capsys, "the input --ckpt")
        assert chain.is_file()


@pytest.mark.parametrize("plain", [False, True])
def test_a_second_export_into_the_same_folder_while_one_runs_is_refused(single, tmp_path, capsys, monkeypatch, plain):
    import specheads.export.dspark as dspark_export
    import specheads.export.run as run_export

    out, seconds = tmp_path / "out", []
    second = ["export", "--ckpt", str(head_checkpoint(tmp_path / "second.ckpt", random_head(), labelled_by(single))),
              "--into-dspark", str(single), "--out", str(out), "--overwrite"]
    module, name = (run_export, "render_card") if plain else (dspark_export, "write_weights")
    original = getattr(module, name)

    def meanwhile(*args, **kwargs):
        seconds.append(main(second))  # another export into the same folder, while this one writes
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, meanwhile)
    if plain:
        first = head_checkpoint(tmp_path / "first.ckpt", build_head("specdecpp_resnet", hidden_size=HIDDEN))
        code = main(["export", "--ckpt", str(first), "--out", str(out)])
    else:
        code, out = export(tmp_path, random_head(), single)
    captured = capsys.readouterr()
    assert code == 0 and seconds == [2], captured
    assert "is being written by another `specheads export`" in captured.err
    assert (out / "config.json").is_file() and not list(out.glob(".specheads-*"))
    assert not [p for p in tmp_path.glob(".*")]


class Unhandled(Exception):
    """The signal reached the test's own handler: nothing in specheads took it."""


@pytest.mark.parametrize("name,exit_code,out_exists", [("SIGTERM", 143, True), ("SIGINT", 130, False)])
def test_an_interrupted_export_leaves_nothing_behind(single, tmp_path, capsys, monkeypatch, name, exit_code,
                                                     out_exists):
    import specheads.export.dspark as dspark_export

    signum = getattr(signal, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)  # mid-export: the checkpoint is copied, the head not yet written
        time.sleep(30)
        raise AssertionError(f"{name} did not stop the export")

    def unhandled(number, frame):
        raise Unhandled(number)

    monkeypatch.setattr(dspark_export, "write_weights", interrupted)
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    checkpoint = head_checkpoint(tmp_path / "head.ckpt", random_head(), labelled_by(single))
    previous = signal.signal(signum, unhandled)  # without specheads' own handler this test fails, not pytest
    try:
        code = main(["export", "--ckpt", str(checkpoint), "--into-dspark", str(single), "--out", str(out)])
    finally:
        signal.signal(signum, previous)
    error = capsys.readouterr().err.strip()
    assert code == exit_code and len(error.splitlines()) == 1 and name in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["head.ckpt", *(["out"] if out_exists else [])])
    if out_exists:
        assert not list(out.iterdir())


def test_a_plain_exports_error_midway_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    import specheads.export.run as run_export

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_export, "render_card", broken)
    checkpoint = head_checkpoint(tmp_path / "head.ckpt", build_head("specdecpp_resnet", hidden_size=HIDDEN))
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "out")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.ckpt"]
    capsys.readouterr()


def test_a_plain_export_refuses_weights_that_overflow_the_stored_dtype(tmp_path, capsys):
    head = build_head("specdecpp_resnet", hidden_size=HIDDEN)
    with torch.no_grad():
        next(p for p in head.parameters() if p.ndim >= 2).fill_(1e6)  # finite in float32, infinite in float16
    checkpoint = head_checkpoint(tmp_path / "head.ckpt", head.eval())
    out = tmp_path / "out"
    code = main(["export", "--ckpt", str(checkpoint), "--out", str(out), "--weights-dtype", "float16"])
    refused(code, capsys, "NaN or infinite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.ckpt"]
