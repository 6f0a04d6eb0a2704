"""The review's defects in loading, exporting and the demo's folder, each pinned by a test that failed before its fix."""

import json
import os
from pathlib import Path

import huggingface_hub
import pytest

from specheads.artifacts.checkpoint import load_trained
from specheads.cli import main
from specheads.demo.run import MARKER, prepare_folder
from specheads.heads import load_head
from specheads.heads.calibration import PositionCalibration
from specheads.pair.models import ModelSpec, draft_identity, load_pair
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import replace_folder


@pytest.fixture(scope="module")
def head_folder(trained, tmp_path_factory) -> Path:
    """The SpecDec++ head exported without a report (no eval: seconds)."""
    _, root = trained
    out = tmp_path_factory.mktemp("heads") / "head"
    assert main(["export", "--ckpt", str(root / "specdecpp" / "checkpoints" / "last.ckpt"), "--out", str(out)]) == 0
    return out


def test_load_head_compares_the_draft_identity_and_names_the_part_that_differs(head_folder, tiny_model, tmp_path):
    config = json.loads((head_folder / "config.json").read_text())
    target_spec, draft_spec = ModelSpec(path=str(tiny_model)), ModelSpec(skip_layers=config["draft"]["weights"]["skip_layers"])
    pair = load_pair(target_spec, draft_spec)
    mine = draft_identity(draft_spec, pair.draft, config.get("state_layer"), target=(target_spec, pair.target))
    load_head(str(head_folder), expect_draft=mine)  # the draft it was trained for passes
    # a self-speculative draft of another target: same name, same skipped layers, other weights
    other = tmp_path / "other-target"
    other.mkdir()
    for file in tiny_model.iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x80\x3f")
    other_spec = ModelSpec(path=str(other))
    theirs = draft_identity(draft_spec, pair.draft, config.get("state_layer"), target=(other_spec, pair.target))
    assert theirs["name"] == mine["name"]
    with pytest.raises(UsageError, match=r"differs in target_weights\.(spec\.path|weights_sha256)"):
        load_head(str(head_folder), expect_draft=theirs)
    with pytest.raises(UsageError, match=r"differs in state_layer \(None here, 2 expected\)"):
        load_head(str(head_folder), expect_draft={**mine, "state_layer": 2})
    with pytest.raises(UsageError, match=r"differs in name \('target minus layers 2' here, 'my-draft' expected\)"):
        load_head(str(head_folder), expect_draft="my-draft")
    with pytest.raises(UsageError, match="pass target="):
        draft_identity(draft_spec, pair.draft)


def test_the_weights_digest_sees_the_calibration(trained):
    _, root = trained
    head = load_trained(str(root / "specdecpp" / "checkpoints" / "last.ckpt")).head
    before = head.weights_digest()
    head.set_calibration(PositionCalibration(scale=(1.0, 0.5), bias=(0.0, -1.0)))
    calibrated = head.weights_digest()
    head.set_calibration(PositionCalibration(scale=(1.0, 0.5), bias=(0.0, -2.0)))
    assert len({before, calibrated, head.weights_digest()}) == 3
    head.set_calibration(None)
    assert head.weights_digest() == before


def test_replacing_a_head_folder_never_leaves_neither(tmp_path, monkeypatch):
    out, new = tmp_path / "head", tmp_path / ".head.new"
    out.mkdir()
    (out / "config.json").write_text("old")
    new.mkdir()
    (new / "config.json").write_text("new")
    seen = []
    original_rename = Path.rename

    def watching_rename(self, target):  # the two-rename fallback would be seen here with `out` missing
        seen.append(out.exists())
        return original_rename(self, target)

    monkeypatch.setattr(Path, "rename", watching_rename)
    replace_folder(new, out)
    assert (out / "config.json").read_text() == "new" and not new.exists()
    assert all(seen) and sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_a_hub_id_without_a_network_fails_at_once_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    calls = []
    original = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        calls.append(kwargs.get("local_files_only"))
        return original(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    with pytest.raises(UsageError, match=r"not a local folder nor in the Hugging Face cache, and the Hub cannot be "
                                         r"used \(HF_HUB_OFFLINE is set\)") as refused:
        load_head("someone/a-head")
    assert calls == [True] and "\n" not in str(refused.value)


def test_parse_errors_name_flags_as_users_type_them(capsys):
    for argv, flag in ((["gen", "--out", "x", "--samples-per-prompt", "abc"], "--samples-per-prompt"),
                       (["gen", "--out", "x", "--sampling.max-new-tokens", "0"], "--sampling.max-new-tokens"),
                       (["gen", "--out", "x", "--no-such-flag", "3"], "--no-such-flag")):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert flag in error and "_" not in error.split(";")[0], error


def test_demo_overwrite_deletes_only_a_folder_the_demo_made(tmp_path):
    users = tmp_path / "home"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    with pytest.raises(UsageError, match=rf"--overwrite deletes only a folder `specheads demo` made.*no {MARKER}"):
        prepare_folder(users, overwrite=True)
    assert (users / "thesis.tex").read_text() == "years of work"
    demo = tmp_path / "demo"
    prepare_folder(demo, overwrite=False)
    (demo / "stale.json").write_text("{}")
    prepare_folder(demo, overwrite=True)
    assert sorted(os.listdir(demo)) == [MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_folder(empty, overwrite=True)  # an empty folder the user made is fine
    assert (empty / MARKER).is_file()
