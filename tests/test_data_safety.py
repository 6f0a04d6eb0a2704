"""Data safety: one gen per folder, shards that record their run and checksum, checked by every reader."""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import tiny_args

from specheads.cli import main
from specheads.dataset.shards import read_record, read_table, record_path, shard_path
from specheads.dataset.store import load_labelled, read_manifest
from specheads.plumbing.errors import UsageError


@pytest.fixture()
def finished(tiny_model, prompts_file, tmp_path):
    """A finished folder: 8 prompts x 2 samples, 4 rows a shard, so 4 shards."""
    out = tmp_path / "data"
    args = tiny_args(tiny_model, prompts_file, out, "--num-prompts", "8")
    assert main(args) == 0
    return out, args


def mtimes(out, count):
    return {i: shard_path(out, i).stat().st_mtime_ns for i in range(count)}


def test_a_second_run_into_a_live_folder_is_refused_naming_the_holder(tiny_model, prompts_file, tmp_path):
    out = tmp_path / "live"
    slow = tiny_args(tiny_model, prompts_file, out, "--samples-per-prompt", "8", "--max-new-tokens", "24")
    first = subprocess.Popen([sys.executable, "-m", "specheads", *slow], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not shard_path(out, 0).exists() and first.poll() is None:
        time.sleep(0.02)
    assert first.poll() is None, "the first run must still be labelling"
    os.kill(first.pid, signal.SIGSTOP)  # paused mid-run, lock held, until both second runs have tried
    try:
        for extra in (["--sampling.temperature", "0.5", "--overwrite"], []):
            second = subprocess.run([sys.executable, "-m", "specheads", *slow, *extra], capture_output=True, text=True,
                                    timeout=300)
            assert second.returncode == 2, second.stderr[-2000:]
            assert f"is being written by another `specheads gen` (pid {first.pid}" in second.stderr
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    manifest = read_manifest(out)
    assert manifest["complete"] and manifest["identity"]["sampling"]["temperature"] == 1.0
    assert {record["run"] for record in manifest["shards"]} == {manifest["fingerprint"]}
    assert len(load_labelled(out)) == 12 * 8


def test_a_truncated_or_deleted_shard_is_named_by_readers_and_gen_relabels_exactly_it(finished, capsys):
    out, args = finished
    count = read_manifest(out)["plan"]["num_shards"]
    assert count >= 3
    before = {key: row for key, row in rows_by_key(out).items()}
    times = mtimes(out, count)
    path = shard_path(out, 1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UsageError, match=r"shard-00001\.arrow holds \d+ bytes but \d+ were written"):
        load_labelled(out)
    shard_path(out, 2).unlink()
    with pytest.raises(UsageError, match=r"shard-00001\.arrow .* run the same `specheads gen` command again"):
        load_labelled(out)
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "shard-00001.arrow holds" in err and "shard-00002.arrow is missing" in err and "shard-00000" not in err
    after = mtimes(out, count)
    assert after[0] == times[0] and all(after[i] == times[i] for i in range(3, count))  # the rest untouched
    assert after[1] != times[1]
    again = rows_by_key(out)
    assert sorted(again) == sorted(before)
    for key in before:
        assert np.array_equal(np.asarray(before[key]["accept"]), np.asarray(again[key]["accept"]))
    assert main(args) == 0 and "nothing new to label" in capsys.readouterr().out


def test_a_shard_of_another_run_is_refused_and_relabelled(finished, tiny_model, prompts_file, tmp_path, capsys):
    out, args = finished
    other = tmp_path / "other"
    assert main(tiny_args(tiny_model, prompts_file, other, "--num-prompts", "8", "--seed", "7")) == 0
    for files in ((shard_path, record_path), (shard_path,)):  # with its record, and the Arrow file alone
        for name in files:
            name(out, 1).write_bytes(name(other, 1).read_bytes())
        with pytest.raises(UsageError, match=r"shard-00001\.arrow (was written by another run|holds|carries run)"):
            load_labelled(out)
        capsys.readouterr()
        assert main(args) == 0
        assert "shard-00001.arrow" in capsys.readouterr().err
        assert read_record(out, 1)["run"] == read_manifest(out)["fingerprint"]
        load_labelled(out)


def test_a_flipped_label_is_named_by_shard_and_row_and_relabelled(finished, capsys):
    out, args = finished
    table = read_table(shard_path(out, 0))
    accept = np.asarray(table.column("accept").combine_chunks().flatten().to_numpy(zero_copy_only=False))
    value = next(v for v in accept if 0.05 < v < 0.95)  # a soft label, unlikely to repeat elsewhere
    data = bytearray(shard_path(out, 0).read_bytes())
    where = data.find(struct.pack("<f", value))
    assert where > 0
    for bad, message in ((2.6e38, "outside \\[0, 1\\]"), (float("nan"), "accept = nan is outside")):
        data[where:where + 4] = struct.pack("<f", bad)
        shard_path(out, 0).write_bytes(bytes(data))
        os.utime(shard_path(out, 0))
        with pytest.raises(UsageError, match=rf"shard-00000\.arrow row \d+ \(prompt '.+', sample \d\): .*{message}"):
            load_labelled(out)
    capsys.readouterr()
    assert main(args) == 0  # the sha256 no longer matches: gen labels the shard again
    assert "shard-00000.arrow no longer has the sha256" in capsys.readouterr().err
    assert len(load_labelled(out)) == 16


def rows_by_key(out):
    rows = load_labelled(out).with_format("numpy")
    return {(r["prompt_id"], int(r["sample_index"])): r for r in rows}


def test_the_manifest_records_each_shard(finished):
    out, _ = finished
    manifest = read_manifest(out)
    assert manifest["format_version"] == 2 and len(manifest["shards"]) == manifest["plan"]["num_shards"]
    for index, record in enumerate(manifest["shards"]):
        assert record == json.loads(record_path(out, index).read_text())
        assert record["bytes"] == shard_path(out, index).stat().st_size and record["rows"] == len(read_table(shard_path(out, index)))
    assert sum(record["rows"] for record in manifest["shards"]) == manifest["counts"]["rows"]
