"""The models' fingerprint: every byte of the weights counts, and each file is hashed once per version."""

import os

import torch
from safetensors.torch import save_file

import specheads.pair.digests as digests
from specheads.pair.models import ModelSpec, weights_identity


class Weighted(torch.nn.Module):
    """Stands in for a loaded model: weights_identity reads only its class name and config."""

    class config:  # noqa: N801 - mimics a transformers config
        _commit_hash = None


def write_model(folder, last_value: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = torch.zeros(1 << 20)  # 4 MiB: a fine-tune that changes only the last value
    weights[-1] = last_value
    save_file({"w": weights}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"hidden_size": 8}')


def test_a_fine_tune_of_the_same_shape_gets_another_fingerprint_and_digests_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    write_model(base, 0.0)
    write_model(tuned, 1.0)
    assert (base / "model.safetensors").stat().st_size == (tuned / "model.safetensors").stat().st_size

    def identity(folder):
        return weights_identity(ModelSpec(path=str(folder)), Weighted())["weights_sha256"]

    assert identity(base) != identity(tuned)
    hashed = []
    real = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    first = identity(base)
    assert first == identity(base) and hashed == []  # both files came from the cache
    write_model(base, 2.0)  # rewritten in place: size equal, mtime newer
    stat = (base / "model.safetensors").stat()
    os.utime(base / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert identity(base) != first and "model.safetensors" in hashed


def with_metadata_order(source, target, order) -> None:
    """A copy of the safetensors file `source` whose header lists its metadata keys in `order` (safetensors itself
    writes them in a per-process hash order)."""
    import json
    import struct

    data = source.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    header["__metadata__"] = {key: header["__metadata__"][key] for key in order}
    text = json.dumps(header, separators=(",", ":")).ljust(size)
    assert len(text) == size
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data[:8] + text.encode() + data[8 + size:])


def test_the_same_tensors_saved_with_metadata_in_another_order_keep_their_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    written = tmp_path / "written.safetensors"
    save_file({"w": torch.arange(6.0)}, str(written), metadata={"format": "pt", "source": "a", "zz": "1"})
    for name, order in (("one", ["format", "source", "zz"]), ("two", ["zz", "format", "source"]),
                        ("other", ["source", "zz", "format"])):
        with_metadata_order(written, tmp_path / name / "model.safetensors", order)
    (tmp_path / "other" / "model.safetensors").write_bytes(
        (tmp_path / "other" / "model.safetensors").read_bytes().replace(b'"a"', b'"b"'))

    def identity(folder):
        return weights_identity(ModelSpec(path=str(tmp_path / folder)), Weighted())["weights_sha256"]

    one, two = tmp_path / "one" / "model.safetensors", tmp_path / "two" / "model.safetensors"
    assert one.read_bytes() != two.read_bytes()
    assert identity("one") == identity("two") != identity("other")
    # a header already in sorted order (a single-key one included) hashes as its bytes: recorded digests still hold
    assert digests.weights_sha256(one) == digests.file_sha256(one) != digests.file_sha256(two)


def test_a_head_recorded_before_the_metadata_was_sorted_still_fits_its_unchanged_model(tmp_path, monkeypatch):
    """A record of the old whole-file digest is honoured for the very files it was made from; a changed file is not."""
    from specheads.integrations.transformers import weights_mismatch
    from specheads.pair.models import whole_file_weights_sha256

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    written = tmp_path / "written.safetensors"
    save_file({"w": torch.arange(6.0)}, str(written), metadata={"format": "pt", "source": "a", "zz": "1"})
    folder = tmp_path / "model"
    with_metadata_order(written, folder / "model.safetensors", ["zz", "format", "source"])
    spec = ModelSpec(path=str(folder))

    class Loaded(Weighted):
        config = type("config", (), {"_commit_hash": None, "name_or_path": str(folder)})

    old = whole_file_weights_sha256(spec)
    assert old != weights_identity(spec, Loaded())["weights_sha256"]  # the unsorted header: two digests
    recorded = {"class": "Loaded", "spec": {"path": str(folder)}, "weights_sha256": old}
    assert weights_mismatch(recorded, Loaded()) is None
    assert weights_mismatch({**recorded, "weights_sha256": "0" * 16}, Loaded()) is not None
