"""`specheads export` and `heads.load_head`: round trip, Hub upload/download faked at the client, refusals, card."""

import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch

from specheads.artifacts.checkpoint import load_trained
from specheads.cli import main
from specheads.heads import load_head
from specheads.plumbing.errors import UsageError

SECRET = "hf_SECRETtoken0123456789"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The SpecDec++ head evaluated (tiny decoding sweep) and exported with its report."""
    data, root = trained
    base = tmp_path_factory.mktemp("export")
    checkpoint = root / "specdecpp" / "checkpoints" / "last.ckpt"
    assert main(["eval", "--head", str(checkpoint), "--data", str(data), "--out", str(base / "report"),
                 "--num-decode-prompts", "4", "--max-new-tokens", "6", "--max-draft", "3", "--constant-ks", "[1,3]",
                 "--head-thresholds", "[0.5]", "--bootstrap", "10", "--progress", "false"]) == 0
    out = base / "head"
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(out), "--report", str(base / "report")]) == 0
    return checkpoint, out, base / "report"


def test_round_trip_gives_identical_predictions(exported):
    checkpoint, out, _ = exported
    original = load_trained(str(checkpoint)).head
    head, rule = load_head(str(out), expect_draft="target minus layers 2")
    hidden, signals = torch.randn(7, 32), torch.randn(7, len(original.extra_features))
    assert torch.equal(original.predict(hidden, signals), head.predict(hidden, signals))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "custom_generate", "model.safetensors",
                                                     "roc.png"]
    config = json.loads((out / "config.json").read_text())
    for key in ("head_type", "hidden_size", "depth", "reads", "draft", "target", "sampling", "decision_rule",
                "training_data", "metrics"):
        assert key in config, key
    assert config["reads"] == "candidate_state" and config["draft"]["name"] == "target minus layers 2"
    report = json.loads((exported[2] / "metrics.json").read_text())
    assert rule.tuned and rule.threshold == report["decision_rule"]["threshold"]
    assert config["metrics"]["auc"] == pytest.approx(report["offline"]["head"]["auc"])


def test_model_card_renders_metrics_and_links_the_plot(exported):
    _, out, report = exported
    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.library_name == "specheads" and "speculative-decoding" in card.data.tags
    metrics = json.loads((report / "metrics.json").read_text())
    auc = metrics["offline"]["head"]["auc"]
    assert f"{auc:.4g}" in card.text and "](roc.png)" in card.text and "specheads eval" in card.text
    strongest = metrics["verdict"]["decoding"]["strongest_baseline"]  # the free rule the head must beat, named
    assert f"| strongest free rule in decoding | {strongest}" in card.text


def test_export_refuses_the_report_of_another_head(exported, trained, tmp_path, capsys):
    checkpoint, _, report = exported
    _, root = trained
    metrics = json.loads((report / "metrics.json").read_text())

    def report_of(name: str, head: dict) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.json").write_text(json.dumps({**metrics, "head": {**metrics["head"], **head}}))
        return folder

    verifier = report_of("verifier", {"config": {**metrics["head"]["config"], "head_type": "sprinter_linear"},
                                      "reads": "context_state", "weights_digest": "0123456789abcdef"})
    other = report_of("other", {"weights_digest": "0123456789abcdef"})
    older = report_of("older", {"weights_digest": None})
    for folder, reason in ((verifier, "evaluated a sprinter_linear head (reads context_state), but"),
                           (other, "evaluated another head (weights 0123456789abcdef"),
                           (older, "no weights digest (an older report)")):
        out = tmp_path / f"head-{folder.name}"
        assert main(["export", "--ckpt", str(checkpoint), "--out", str(out), "--report", str(folder)]) == 2
        error = capsys.readouterr().err
        assert reason in error and str(checkpoint) in error and len(error.strip().splitlines()) == 1
        assert not out.exists()
    # the verifier's own checkpoint with the SpecDec++ head's report: refused the other way round
    out = tmp_path / "head-swapped"
    assert main(["export", "--ckpt", str(root / "sprinter" / "checkpoints" / "last.ckpt"), "--out", str(out),
                 "--report", str(report)]) == 2
    assert "evaluated a specdecpp_resnet head (reads candidate_state)" in capsys.readouterr().err and not out.exists()


def test_untuned_export_without_a_report(trained, tmp_path):
    _, root = trained
    out = tmp_path / "head"
    assert main(["export", "--ckpt", str(root / "sprinter" / "checkpoints" / "last.ckpt"), "--out", str(out)]) == 0
    head, rule = load_head(str(out))
    config = json.loads((out / "config.json").read_text())
    assert not rule.tuned and config["reads"] == "context_state" and config["tau"] == 1.0
    assert main(["export", "--ckpt", str(root / "sprinter" / "checkpoints" / "last.ckpt"), "--out", str(out)]) == 2


def test_push_and_load_through_the_hub_client(exported, tmp_path, monkeypatch, capsys):
    checkpoint, out, report = exported
    calls = {}

    def create_repo(self, repo_id, private=False, exist_ok=False, **kwargs):
        calls["create_repo"] = (repo_id, private)

    def create_branch(self, repo_id, branch, exist_ok=False, **kwargs):
        calls["create_branch"] = branch

    def upload_folder(self, repo_id, folder_path, revision=None, commit_message=None, **kwargs):
        calls["upload"] = {"repo_id": repo_id, "revision": revision,
                           "files": {p.relative_to(folder_path).as_posix(): p.read_bytes()
                                     for p in Path(folder_path).rglob("*") if p.is_file()}}
        return huggingface_hub.CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/abc", commit_message="",
                                          commit_description="", oid="abc")

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    pushed = tmp_path / "pushed"
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(pushed), "--report", str(report),
                 "--push-to-hub", "me/my-head", "--private", "--revision", "v1"]) == 0
    assert calls["create_repo"] == ("me/my-head", True) and calls["create_branch"] == "v1"
    assert calls["upload"]["revision"] == "v1"
    assert set(calls["upload"]["files"]) == {"README.md", "config.json", "model.safetensors", "roc.png",
                                             "custom_generate/generate.py", "custom_generate/requirements.txt"}
    assert calls["upload"]["files"]["model.safetensors"] == (pushed / "model.safetensors").read_bytes()
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err
    assert all(SECRET.encode() not in data for data in calls["upload"]["files"].values())

    downloads = {}

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        downloads.update(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns)
        local = tmp_path / "hub-cache"
        shutil.copytree(pushed, local, dirs_exist_ok=True)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    head, rule = load_head("me/my-head", revision="v1")
    assert downloads["repo_id"] == "me/my-head" and downloads["revision"] == "v1"
    assert "model.safetensors" in downloads["allow_patterns"] and not any(".bin" in p for p in downloads["allow_patterns"])
    assert rule.tuned


def test_a_push_without_the_network_ends_in_one_line_and_is_retried_without_overwrite(exported, tmp_path, monkeypatch,
                                                                                    capsys):
    class ConnectError(Exception):
        """Stands in for the HTTP client's own error type (httpx's), which export cannot list in advance."""

    checkpoint, _, report = exported
    monkeypatch.setenv("HF_TOKEN", SECRET)
    pushed = tmp_path / "pushed"
    command = ["export", "--ckpt", str(checkpoint), "--out", str(pushed), "--report", str(report),
               "--push-to-hub", "me/my-head"]

    def unreachable(self, *args, **kwargs):
        raise ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    assert main(command) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "ConnectError" in error and f"written in {pushed}" in error
    assert SECRET not in error and (pushed / "model.safetensors").is_file()
    monkeypatch.undo()  # the real client, offline: huggingface_hub's own refusal, still one line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert main(command) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "pushing to me/my-head failed" in error and SECRET not in error
    uploads = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **k: uploads.append(k["folder_path"]))
    written = (pushed / "model.safetensors").stat().st_mtime_ns
    assert main(command) == 0  # back online: the same command pushes the folder it wrote, no --overwrite needed
    assert uploads == [str(pushed)] and (pushed / "model.safetensors").stat().st_mtime_ns == written


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_report_whose_plot_is_a_link_or_a_special_file_is_refused(exported, tmp_path, capsys, kind):
    checkpoint, _, report = exported
    linked = tmp_path / "report"
    shutil.copytree(report, linked)
    (linked / "roc.png").unlink()
    if kind == "link":
        (tmp_path / "private.txt").write_text("not to be published")
        (linked / "roc.png").symlink_to(tmp_path / "private.txt")
    else:
        os.mkfifo(linked / "roc.png")
    out = tmp_path / "head"
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(out), "--report", str(linked)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "roc.png is a " in error and "not a regular file" in error, error
    assert not out.exists() and not list(tmp_path.glob(".head.*"))


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("breakage, message", [
    ("missing", r"has no model\.safetensors"),
    ("pickled", r"pickled weights \(pytorch_model\.bin\)"),
    ("shape", r"the weights do not fit config\.json \(hidden_size 64, depth \d\): shaped blocks\.0\.bias \[\d+\] \(config: "),
    ("unknown", r"unknown head type 'medusa'; known: specdecpp_resnet, specdecpp_ontime, expected_acceptance, sprinter_linear"),
    ("draft", r"trained for another draft: it differs in name \('target minus layers 2' here, 'my-draft' expected\)"),
    ("depth", r"the weights do not fit config\.json \(hidden_size 32, depth 5\): missing blocks\.3\.bias"),
    ("renamed pickle", r"model\.safetensors is not a safetensors file"),
])
def test_load_head_refusals(exported, tmp_path, breakage, message):
    folder = copy_of(exported[1], tmp_path)
    expect = None
    if breakage == "missing":
        (folder / "model.safetensors").unlink()
    elif breakage == "pickled":
        torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    elif breakage == "shape":
        edit_config(folder, hidden_size=64)
    elif breakage == "unknown":
        edit_config(folder, head_type="medusa")
    elif breakage == "depth":
        edit_config(folder, depth=5)
    elif breakage == "renamed pickle":
        torch.save({"x": torch.zeros(1)}, folder / "model.safetensors")
    else:
        expect = "my-draft"
    with pytest.raises(UsageError, match=message):
        load_head(str(folder), expect_draft=expect)
    if breakage in ("depth", "renamed pickle"):  # through the commands too: one line, exit 2
        assert main(["export", "--ckpt", str(folder), "--out", str(tmp_path / "again")]) == 2


class WritesAMarker:
    """Unpickling this runs code: it writes the file it names."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_malicious_pickle_given_as_a_checkpoint_runs_no_code(trained, tmp_path, capsys):
    data, _ = trained
    marker = tmp_path / "marker"
    payload = {"state_dict": {}, "hyper_parameters": {"head": "specdecpp_resnet", "hidden_size": 32},
               "evil": WritesAMarker(marker)}
    crafted = tmp_path / "crafted.ckpt"
    torch.save(payload, crafted)
    run_folder = tmp_path / "run"
    (run_folder / "checkpoints").mkdir(parents=True)
    shutil.copyfile(crafted, run_folder / "checkpoints" / "last.ckpt")
    head_folder = tmp_path / "head-folder"
    head_folder.mkdir()
    shutil.copyfile(crafted, head_folder / "model.bin")
    for given in (crafted, run_folder, head_folder / "model.bin", head_folder):
        for command in (["eval", "--head", str(given), "--data", str(data), "--out", str(tmp_path / "report"),
                         "--num-decode-prompts", "0", "--progress", "false"],
                        ["export", "--ckpt", str(given), "--out", str(tmp_path / "exported")]):
            assert main(command) == 2, command
            error = capsys.readouterr().err.strip()
            assert len(error.splitlines()) == 1 and ("weights_only" in error or "pickled weights" in error), error
            assert not marker.exists(), command
    assert not (tmp_path / "report").exists() and not (tmp_path / "exported").exists()
    # the same payload loaded the unsafe way does run: the test would catch a return to weights_only=False
    torch.load(crafted, weights_only=False)
    assert marker.read_text() == "ran"


def test_an_exported_folder_is_readable_by_others_under_the_usual_umask(trained, tmp_path):
    import os
    import stat

    _, root = trained
    out = tmp_path / "head"
    previous = os.umask(0o022)
    try:
        assert main(["export", "--ckpt", str(root / "sprinter" / "checkpoints" / "last.ckpt"), "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "README.md": 0o644, "config.json": 0o644, "model.safetensors": 0o644}


def test_half_precision_export_halves_the_file_and_loads_as_float32(trained, tmp_path):
    _, root = trained
    checkpoint = str(root / "specdecpp" / "checkpoints" / "last.ckpt")
    for dtype in ("float32", "float16"):
        assert main(["export", "--ckpt", checkpoint, "--out", str(tmp_path / dtype), "--weights-dtype", dtype]) == 0
    full, half = (tmp_path / "float32" / "model.safetensors").stat().st_size, (tmp_path / "float16" / "model.safetensors").stat().st_size
    assert half < 0.6 * full
    original = load_trained(checkpoint).head
    head, _ = load_head(str(tmp_path / "float16"))
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    assert json.loads((tmp_path / "float16" / "config.json").read_text())["weights_dtype"] == "float16"
    assert "--weights-dtype float16" in (tmp_path / "float16" / "README.md").read_text()
    hidden, signals = torch.randn(64, 32), torch.randn(64, len(original.extra_features))
    assert not torch.equal(original.predict(hidden, signals), head.predict(hidden, signals))  # stored rounded
    assert torch.allclose(original.predict(hidden, signals), head.predict(hidden, signals), atol=2e-3)


def test_the_shipped_head_loads_by_its_name_and_an_unknown_name_lists_the_shipped_ones():
    from specheads.heads.loading import shipped_heads

    head, rule = load_head("smollm2-ontime", expect_draft="target minus layers 20-21")
    assert "smollm2-ontime" in shipped_heads() and head.decides == "at_draft" and head.state_layer == 20
    # calibrated within the bar on held-out prompts, so it carries the rule read from the costs, tuned nowhere
    assert rule.rule == "draft_while_the_next_candidate_pays" and not rule.tuned
    with pytest.raises(UsageError, match="smollm2-ontime"):
        load_head("smollm2-ontimee")
