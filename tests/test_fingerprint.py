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
