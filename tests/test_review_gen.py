"""The review of `specheads gen`: a finished multi-rank re-run ends on every rank, imported responses end at their
first stop token, an ignored setting stays out of the fingerprint, the facts cache grows linearly and never in the
user's own cache, and a shard that cannot be read for a moment is never deleted."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_args

import specheads.dataset.shards as shards
from specheads.cli import main
from specheads.dataset.store import load_labelled, read_manifest
from specheads.pair.digests import cached_sha256
from specheads.pair.embedded import cache_root
from specheads.plumbing.errors import UsageError
from specheads.plumbing.lock import lock_files

CONFIGS = Path(__file__).parents[1] / "configs" / "gen"


def torchrun(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m specheads ARGS` (gloo on the CPU); a run still going after `timeout` seconds is
    killed with every process it started, and the test fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "specheads", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"torchrun did not end within {timeout} s (a rank hangs): {err[-1500:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def ranks_output(stderr: str) -> str:
    """What the ranks printed before torchrun's own report of a failed rank (its traceback would fill the message)."""
    return stderr.split("torch/distributed/elastic/multiprocessing/api.py")[0][-2500:]


def folder_times(out: Path) -> dict[str, int]:
    """When each file of the dataset was last written (the lock's files, rewritten by every run, left out)."""
    return {str(path.relative_to(out)): path.stat().st_mtime_ns for path in out.rglob("*")
            if path.is_file() and path.name not in lock_files("gen")}


def test_a_finished_run_started_again_under_torchrun_ends_on_every_rank(tiny_model, prompts_file, tmp_path):
    out = tmp_path / "data"
    args = tiny_args(tiny_model, prompts_file, out, "--num-prompts", "4", "--devices", "2")
    first = torchrun(args, timeout=400)
    assert first.returncode == 0, ranks_output(first.stderr)
    assert read_manifest(out)["complete"] and len(load_labelled(out)) == 8
    before = folder_times(out)
    again = torchrun(args, timeout=150)  # rank 1 used to wait at a barrier rank 0 never reached
    assert again.returncode == 0, ranks_output(again.stderr)
    assert again.stdout.count("nothing new to label") == 1, again.stdout  # rank 0 reports, once
    assert folder_times(out) == before  # nothing labelled or rewritten


def test_a_run_ends_its_process_group_before_the_interpreter_exits(tmp_path):
    import torch.distributed as dist

    # a gloo group left to the interpreter's exit aborted a finished rank now and then (SIGABRT under torchrun)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert main(["gen", "--no-such-flag"]) == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_imported_responses_end_at_their_first_stop_token_keeping_it(capsys, tiny_model, prompts_file, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    eos = tokenizer.eos_token_id

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    responses = tmp_path / "responses.jsonl"
    responses.write_text("\n".join(json.dumps(record) for record in [
        {"id": "p0", "response_ids": encode("It is 4.") + [eos] + encode("Hello! How can I help")},
        {"id": "p0", "response": "The quick brown fox.<|im_end|>def add(a, b)"},  # the engine ran on past its EOS
        {"id": "p1", "response": "A large model"},  # stopped at EOS (finish_reason "stop"): EOS appended
        {"id": "p1", "response_ids": encode("What is 2 + 2?") + [eos]},  # ends at its stop token: nothing cut
    ]) + "\n")
    out = tmp_path / "out"
    assert main(tiny_args(tiny_model, prompts_file, out, "--responses", str(responses), "--num-prompts", "2",
                          "--samples-per-prompt", "1", "--max-new-tokens", "40")) == 0
    rows = {(r["prompt_id"], r["sample_index"]): r["target_ids"] for r in load_labelled(out)}
    assert rows == {("p0", 0): encode("It is 4.") + [eos], ("p0", 1): encode("The quick brown fox.") + [eos],
                    ("p1", 0): encode("A large model") + [eos], ("p1", 1): encode("What is 2 + 2?") + [eos]}
    manifest = read_manifest(out)
    assert manifest["counts"]["cut_at_stop_responses"] == 2 and manifest["counts"]["truncated_responses"] == 0
    assert "| imported responses cut at their first stop token | 2 |" in (out / "README.md").read_text()
    assert "cut 2 imported responses at the first stop token" in capsys.readouterr().out


def test_samples_per_prompt_is_ignored_with_imported_responses_and_stays_out_of_the_fingerprint(
        capsys, tiny_model, prompts_file, tmp_path):
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps({"id": f"p{i}", "response": "It is 4."}) + "\n" for i in range(2)))
    out = tmp_path / "out"

    def gen(samples: str) -> int:
        return main(tiny_args(tiny_model, prompts_file, out, "--responses", str(responses), "--num-prompts", "2",
                              "--samples-per-prompt", samples))

    assert gen("1") == 0
    fingerprint = read_manifest(out)["fingerprint"]
    printed = capsys.readouterr()
    assert "samples_per_prompt" not in printed.err  # the default: nothing to say
    assert gen("3") == 0  # the same rows: the finished dataset is kept, not refused as another fingerprint
    printed = capsys.readouterr()
    assert "nothing new to label" in printed.out
    notes = [line for line in printed.err.splitlines() if "samples_per_prompt" in line]
    assert len(notes) == 1 and "ignored" in notes[0] and "--responses" in notes[0], printed.err
    assert read_manifest(out)["fingerprint"] == fingerprint and len(load_labelled(out)) == 2


def written_bytes() -> int:
    """Bytes this process has written so far (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts written bytes through /proc/self/io")
def test_the_facts_cache_writes_each_fact_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    files = []
    for index in range(400):
        files.append(tmp_path / "files" / f"file-{index:04d}.bin")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_bytes(index.to_bytes(4, "little"))
    start = written_bytes()
    digests = [cached_sha256(path) for path in files]
    per_fact = (written_bytes() - start) / len(files)
    assert per_fact < 2_000, f"{per_fact:.0f} bytes written per fact: the cache is rewritten whole for each one"
    # a fresh process finds every fact without hashing again
    script = ("import sys; from pathlib import Path; import specheads.pair.digests as d\n"
              "d.file_sha256 = lambda path: sys.exit(f'hashed {path}')\n"
              "print(' '.join(d.cached_sha256(Path(p)) for p in sys.argv[1:]))")
    fresh = subprocess.run([sys.executable, "-c", script, *map(str, files)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "SPECHEADS_CACHE": str(tmp_path / "cache")})
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.split() == digests


def test_the_tests_keep_their_facts_out_of_the_users_cache_but_share_its_converted_models(tmp_path):
    import conftest

    users = {Path.home() / ".cache" / "specheads", Path(getattr(conftest, "USER_CACHE", Path.home() / ".cache" / "specheads"))}
    assert all(not cache_root().resolve().is_relative_to(user.resolve()) for user in users), cache_root()
    probe = tmp_path / "probe-file.bin"
    probe.write_bytes(b"probe")
    cached_sha256(probe)
    for user in users:
        for facts in user.glob("file-facts*"):
            assert str(probe) not in facts.read_text(errors="replace"), facts
    assert any(str(probe) in facts.read_text() for facts in cache_root().glob("file-facts*"))
    # the embedded model converted once (about 30 s) is found where the user's own runs keep it
    assert (cache_root() / "models").resolve() == (Path(conftest.USER_CACHE) / "models").resolve()


@pytest.fixture(scope="module")
def finished_data(tiny_model, prompts_file, tmp_path_factory):
    """A finished folder of 3 shards (6 prompts x 2 samples, 4 rows a shard)."""
    out = tmp_path_factory.mktemp("review") / "data"
    args = tiny_args(tiny_model, prompts_file, out, "--num-prompts", "6")
    assert main(args) == 0
    return out, args


@pytest.mark.parametrize("read", ["read_table", "file_sha256"])
def test_a_shard_that_cannot_be_read_for_a_moment_is_kept_and_named(read, finished_data, monkeypatch, capsys):
    out, args = finished_data
    before = folder_times(out)
    real = getattr(shards, read)

    def flaky(path, *rest):
        if Path(path).name == "shard-00001.arrow":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *rest)

    monkeypatch.setattr(shards, read, flaky)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specheads gen: error:")]
    assert len(lines) == 1 and "shard-00001.arrow" in lines[0] and "Input/output error" in lines[0], err
    assert "nothing was deleted" in lines[0] and "run the same command again" in lines[0], lines[0]
    assert folder_times(out) == before and read_manifest(out)["complete"]


def test_a_record_that_cannot_be_read_for_a_moment_is_not_taken_for_a_missing_one(finished_data, monkeypatch):
    out, _ = finished_data
    real = Path.read_text

    def flaky(self, *args, **kwargs):
        if self.name == "shard-00001.json":
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", flaky)
    fingerprint = read_manifest(out)["fingerprint"]
    assert shards.shard_problem(out, 0, fingerprint, None, deep=True) is None
    with pytest.raises(UsageError, match=r"shard-00001\.arrow could not be checked .*Input/output error.*nothing was "
                                         r"deleted"):
        shards.shard_problem(out, 1, fingerprint, None, deep=True)


def test_a_shard_whose_content_is_damaged_is_still_relabelled(finished_data, capsys):
    out, args = finished_data
    path = shards.shard_path(out, 2)
    data = bytearray(path.read_bytes())
    data[8:48] = os.urandom(40)  # the schema message: pyarrow raises OSError for it, a readable file all the same
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(args) == 0
    assert "shard-00002.arrow is not a readable Arrow file" in capsys.readouterr().err
    assert len(load_labelled(out)) == 12


def test_the_llama_config_says_what_its_top_k_does():
    from specheads.data_gen.cli import parse_config

    config = parse_config(["--config", str(CONFIGS / "llama2-70b-7b.yaml")])
    transform = config.sampling.transform()
    import torch

    logits = torch.randn(4, 32000)
    plain = (logits / config.sampling.temperature).log_softmax(-1)
    assert torch.allclose(transform.log_probs(logits), plain)  # top_k 0 and top_p 1 keep every token
    lines = (CONFIGS / "llama2-70b-7b.yaml").read_text().splitlines()
    comment = next(line for line in lines if line.lstrip().startswith("top_k:")).split("#", 1)[-1]
    assert "0 keeps every token" in comment, comment
