"""One code path for 1 or N processes: identical rows for 1 and 2 CPU ranks (gloo), and kill-and-resume."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
from conftest import tiny_args

from specheads.dataset.shards import shard_path
from specheads.dataset.store import load_labelled, read_manifest

COLUMNS = ("prompt_ids", "target_ids", "draft_ids", "mixed_ids", "is_draft", "logp", "logq", "accept", "beta",
           "entropy", "top1", "top2", "features")


def rows_by_key(out):
    rows = load_labelled(out).with_format("numpy")
    return {(r["prompt_id"], int(r["sample_index"])): r for r in rows}


def test_two_ranks_give_the_same_rows_as_one(tiny_model, prompts_file, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    base = tiny_args(tiny_model, prompts_file, one, "--num-prompts", "6")
    first = subprocess.run([sys.executable, "-m", "specheads", *base], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run([sys.executable, "-m", "specheads",
                             *tiny_args(tiny_model, prompts_file, two, "--num-prompts", "6", "--devices", "2")],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "SPECHEADS_DEBUG": "1"})  # Lightning's rank lines, quiet otherwise
    assert second.returncode == 0, second.stderr[-2000:]
    assert "world_size=2" in second.stderr or "distributed_backend=gloo" in second.stderr
    a, b = rows_by_key(one), rows_by_key(two)
    assert sorted(a) == sorted(b) and len(a) == 12
    for key in a:
        for column in COLUMNS:
            assert np.array_equal(np.asarray(a[key][column]), np.asarray(b[key][column])), (key, column)
    assert read_manifest(one)["fingerprint"] == read_manifest(two)["fingerprint"]


def test_more_ranks_than_shards_finish_with_the_rows_of_one_rank(tiny_model, prompts_file, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    small = ("--num-prompts", "2")  # 2 prompts x 2 samples = 4 rows = one shard of 4, for two ranks
    first = subprocess.run([sys.executable, "-m", "specheads", *tiny_args(tiny_model, prompts_file, one, *small)],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert read_manifest(one)["plan"]["num_shards"] == 1
    second = subprocess.run([sys.executable, "-m", "specheads",
                             *tiny_args(tiny_model, prompts_file, two, *small, "--devices", "2")],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Traceback" not in second.stderr and read_manifest(two)["complete"]
    a, b = rows_by_key(one), rows_by_key(two)
    assert sorted(a) == sorted(b) and len(a) == 4
    for key in a:
        for column in COLUMNS:
            assert np.array_equal(np.asarray(a[key][column]), np.asarray(b[key][column])), (key, column)


def test_killed_run_resumes_and_labels_every_row_once(tiny_model, prompts_file, tmp_path):
    out = tmp_path / "resume"
    args = tiny_args(tiny_model, prompts_file, out, "--samples-per-prompt", "8", "--max-new-tokens", "24",
                     "--rows-per-shard", "4")
    process = subprocess.Popen([sys.executable, "-m", "specheads", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not shard_path(out, 2).exists() and process.poll() is None:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    manifest = read_manifest(out)
    assert manifest is not None and not manifest["complete"], "the run must be cut off mid-way"
    num_shards = manifest["plan"]["num_shards"]
    done_before = {i: shard_path(out, i).stat().st_mtime_ns for i in range(num_shards) if shard_path(out, i).exists()}
    assert 0 < len(done_before) < num_shards
    again = subprocess.run([sys.executable, "-m", "specheads", *args], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert read_manifest(out)["complete"]
    for index, mtime in done_before.items():
        assert shard_path(out, index).stat().st_mtime_ns == mtime, "finished shards must not be redone"
    rows = load_labelled(out)
    keys = list(zip(rows["prompt_id"], rows["sample_index"]))
    assert len(keys) == len(set(keys)) == 12 * 8
    assert not list(out.glob("shards/.*.tmp"))
