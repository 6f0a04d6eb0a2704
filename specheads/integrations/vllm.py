"""A free-draft proposer for vLLM's `custom_class` hook: prompt lookup (or SuffixDecoding's suffix trees) whose
every row's draft is cut by an exported token-only head, at the verify length that maximises the expected tokens per
verify cost (`specheads.lookup.planning.goodput_length`, the rule our round engine runs).

Serve it with (vLLM's V1 model runner: `VLLM_USE_V2_MODEL_RUNNER=0`; Model Runner V2 refuses the method):

    LLM(model, speculative_config={"method": "custom_class", "num_speculative_tokens": K,
                                   "model": "specheads.integrations.vllm.LookupHeadProposer"},
        additional_config={"specheads": {"head": "runs/lookup-head/head", "draft": "lookup",
                                         "max_ngram": 3, "min_ngram": 1}})

`speculative_config` forbids extra fields and vLLM sets `prompt_lookup_min/max` to 0 for a custom class, so the
settings come from `additional_config["specheads"]` (`--additional-config` on `vllm serve`), else from environment
variables (`SPECHEADS_VLLM_HEAD`, `..._DRAFT`, `..._NGRAM` as "min-max", `..._TOKEN_COST`, `..._LOG`); K is
`num_speculative_tokens`. Without a head every row verifies its whole proposal up to K (vLLM's n-gram rule).

vLLM calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)` once a step
(`vllm/v1/worker/gpu_model_runner.py`, `propose_draft_token_ids`): per batch row the tokens the step sampled (empty for a
prefill chunk), the row's token count and the persistent batch's token array, its rows already holding the sampled
tokens; no request ids. So the proposer follows each request by its tokens (`RequestTracker`): a row whose first
count − sampled tokens equal a request it followed continues it, with `sampled − 1` of its last draft accepted;
otherwise it is a new request whose prompt is all but the sampled tokens. The head reads the token features of each
proposal (`specheads.lookup.features`), functions of the row's tokens alone, as our decoder and gen compute them.

With `log` set the proposer appends one JSON line per request start and per round (`specheads train lookup from-logs`
reads them with vLLM's per-request metrics).

This module imports only the standard library, numpy, torch, safetensors, huggingface_hub (for a Hub id, where
installed) and the light `specheads.lookup` package: vLLM's environment has them.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from specheads.lookup.planning import PACKED_CPU_TOKEN_COST, goodput_length, linear_cost
from specheads.lookup.proposers import NO_PROPOSAL, Proposal, SuffixProposer, ngram_propose
from specheads.lookup.token_head import TokenHead
from specheads.plumbing.errors import UsageError

CONFIG_KEY = "specheads"
"""The key of the proposer's settings in vLLM's `additional_config`."""
ENVIRONMENT = {"head": "SPECHEADS_VLLM_HEAD", "draft": "SPECHEADS_VLLM_DRAFT", "ngram": "SPECHEADS_VLLM_NGRAM",
               "token_cost": "SPECHEADS_VLLM_TOKEN_COST", "log": "SPECHEADS_VLLM_LOG"}
"""The environment variables read where `additional_config` gives no value."""
FORGET_AFTER = 64
"""Steps a followed request may be absent from the batch (not scheduled, preempted) before its state is dropped."""


@dataclass(frozen=True)
class ProposerSettings:
    """What the proposer reads of its configuration (module docstring)."""

    head: str | None = None  # an exported token head: a folder or a Hub id
    draft: str = "lookup"  # "lookup" (prompt lookup) or "suffix"
    max_ngram: int = 3
    min_ngram: int = 1
    token_cost: float = PACKED_CPU_TOKEN_COST  # one more verified token in one-token forwards
    log: str | None = None  # a JSONL file the rounds are appended to

    def __post_init__(self) -> None:
        if self.draft not in ("lookup", "suffix"):
            raise UsageError(f"specheads draft {self.draft!r} is not a free draft; give 'lookup' or 'suffix'")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UsageError(f"specheads prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram} and "
                             f"{self.max_ngram}")
        if not (np.isfinite(self.token_cost) and self.token_cost >= 0):
            raise UsageError(f"specheads token_cost is a verified token's cost in one-token forwards (>= 0), got "
                             f"{self.token_cost}")

    @classmethod
    def read(cls, additional: Any, environ: Mapping[str, str]) -> ProposerSettings:
        """The settings from `additional_config[CONFIG_KEY]` (a dict), else from `environ`; unknown keys refused."""
        given = dict(additional.get(CONFIG_KEY) or {}) if isinstance(additional, Mapping) else {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise UsageError(f"additional_config['{CONFIG_KEY}'] has unknown settings {unknown}; give only "
                             f"{sorted(known)}")
        if "head" not in given and environ.get(ENVIRONMENT["head"]):
            given["head"] = environ[ENVIRONMENT["head"]]
        if "draft" not in given and environ.get(ENVIRONMENT["draft"]):
            given["draft"] = environ[ENVIRONMENT["draft"]]
        if "log" not in given and environ.get(ENVIRONMENT["log"]):
            given["log"] = environ[ENVIRONMENT["log"]]
        try:
            if "max_ngram" not in given and environ.get(ENVIRONMENT["ngram"]):
                low, _, high = environ[ENVIRONMENT["ngram"]].partition("-")
                given["min_ngram"], given["max_ngram"] = int(low), int(high or low)
            if "token_cost" not in given and environ.get(ENVIRONMENT["token_cost"]):
                given["token_cost"] = float(environ[ENVIRONMENT["token_cost"]])
            return cls(**{**given, "max_ngram": int(given.get("max_ngram", 3)),
                          "min_ngram": int(given.get("min_ngram", 1)), "token_cost": float(given.get("token_cost",
                                                                                                      PACKED_CPU_TOKEN_COST))})
        except (TypeError, ValueError) as error:
            raise UsageError(f"specheads settings are not numbers where they must be ({error}); e.g. "
                             f"{ENVIRONMENT['ngram']}=1-3, {ENVIRONMENT['token_cost']}=0.043") from None


def head_folder(head: str) -> Path:
    """The folder of `head`: a local folder, else a Hub id downloaded through huggingface_hub where importable."""
    folder = Path(head).expanduser()
    if folder.exists():
        return folder
    if head.count("/") != 1 or head.startswith((".", "/")):
        raise UsageError(f"specheads head {head!r} is neither a folder nor a Hub id (owner/name); give the folder "
                         "`specheads train lookup fit` exported")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UsageError(f"specheads head {head!r} is not a folder and huggingface_hub is not installed to fetch it "
                         "from the Hub; download the head and give its folder") from None
    try:
        return Path(snapshot_download(repo_id=head))
    except Exception as error:  # the Hub's errors have many types: one line is the contract
        raise UsageError(f"specheads head {head!r} is not a folder and the Hub did not give it ({type(error).__name__}); "
                         "give the head's folder") from None


@dataclass
class Followed:
    """A request the proposer follows: its tokens at the last step, prompt length and last draft."""

    request: int
    prompt_length: int
    tokens: np.ndarray
    absent: int = 0  # steps since it was last in the batch


class RequestTracker:
    """Which followed request each batch row holds (module docstring): matched by its tokens, as vLLM passes none."""

    def __init__(self) -> None:
        self.followed: dict[int, Followed] = {}
        self.rows: dict[int, int] = {}  # the request each batch row held at the last step
        self.ids = itertools.count()

    def match(self, index: int, row: np.ndarray, count: int, sampled: int, claimed: set[int]) -> tuple[Followed, bool]:
        """The followed request whose tokens at the last step equal the row's first `count - sampled` tokens (and
        False), or a new one whose prompt they are (and True). The request this row held at the last step is tried
        first, then those seen most recently: at T = 0 a finished request's tokens may equal a new one's prefix.
        A request another row `claimed` this step is not matched again."""
        before = count - sampled
        owner = self.followed.get(self.rows.get(index, -1))
        for state in ([owner] if owner else []) + sorted(self.followed.values(), key=lambda s: s.absent):
            if (state.request not in claimed and len(state.tokens) == before
                    and np.array_equal(state.tokens, row[:before])):
                self.rows[index] = state.request
                return state, False
        state = Followed(next(self.ids), before, np.empty(0, dtype=np.int64))
        self.followed[state.request] = state
        self.rows[index] = state.request
        return state, True

    def age(self, seen: set[int]) -> list[Followed]:
        """Count a step for the requests not `seen`; drop and return those absent for `FORGET_AFTER` steps."""
        dropped = []
        for request, state in list(self.followed.items()):
            state.absent = 0 if request in seen else state.absent + 1
            if state.absent >= FORGET_AFTER:
                dropped.append(self.followed.pop(request))
        return dropped


class LookupHeadProposer:
    """vLLM's custom-class proposer (module docstring): free drafts cut by a token-only head."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.settings = ProposerSettings.read(getattr(vllm_config, "additional_config", None), os.environ)
        self.head = (TokenHead.load(head_folder(self.settings.head), draft_kind=self.settings.draft, target_state_size=0)
                     if self.settings.head else None)
        self.cost = linear_cost(self.settings.token_cost)
        self.suffix = None
        if self.settings.draft == "suffix":
            self.suffix = SuffixProposer(max_tree_depth=spec.suffix_decoding_max_tree_depth,
                                         max_spec_factor=spec.suffix_decoding_max_spec_factor,
                                         min_token_prob=spec.suffix_decoding_min_token_prob)
        self.tracker = RequestTracker()
        self.session = f"{os.getpid()}-{id(self):x}"  # several engines may append to one log
        self.write({"event": "settings", "k": self.k, "draft": self.settings.draft, "max_ngram": self.settings.max_ngram,
                    "min_ngram": self.settings.min_ngram, "max_model_len": self.max_model_len,
                    "head": self.settings.head})

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load: the draft is read from the context."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, *args: Any, **kwargs: Any) -> list[list[int]]:
        """Each batch row's draft (none for a prefill chunk, a row at the model's length or a proposal the head
        cuts to nothing), as vLLM's runner asks (module docstring)."""
        drafts: list[list[int]] = []
        seen: set[int] = set()
        for index, sampled in enumerate(sampled_token_ids):
            count = int(num_tokens_no_spec[index])
            if not len(sampled):
                drafts.append([])
                continue
            row = token_ids_cpu[index, :count]
            state, new = self.tracker.match(index, token_ids_cpu[index], count, len(sampled), seen)
            seen.add(state.request)
            self.advance(state, new, row)
            drafts.append(self.draft(state, row, count))
        for state in self.tracker.age(seen):
            if self.suffix is not None:
                self.suffix.stop(state.request)
        return drafts

    def advance(self, state: Followed, new: bool, row: np.ndarray) -> None:
        """Record the step the request just took and its tokens."""
        if self.suffix is not None:
            if new:
                self.suffix.start(state.request, row[: state.prompt_length])
                self.suffix.extend(state.request, row[state.prompt_length:])
            else:
                self.suffix.extend(state.request, row[len(state.tokens):])
        if new:
            self.write({"event": "start", "request": state.request,
                        "prompt_token_ids": row[: state.prompt_length].tolist()})
        state.tokens = np.array(row, dtype=np.int64)

    def proposal(self, state: Followed, row: np.ndarray, k: int) -> Proposal:
        """The free draft's proposal of at most `k` tokens after the row's context."""
        if k < 1:
            return NO_PROPOSAL
        if self.suffix is not None:
            return self.suffix.propose(state.request, row, k)
        return ngram_propose(row, k, state.prompt_length, self.settings.max_ngram, self.settings.min_ngram)

    def draft(self, state: Followed, row: np.ndarray, count: int) -> list[int]:
        """The row's draft: its proposal cut at the cost-read length of the head's estimates (all of it without a
        head), vLLM's cap at the model's length kept."""
        proposal = self.proposal(state, row, min(self.k, self.max_model_len - count))
        length = len(proposal.tokens)
        if self.head is not None and length:
            length = goodput_length(self.head.estimates(proposal), self.cost)
        self.write({"event": "round", "request": state.request, "start": count - state.prompt_length,
                    "proposed": len(proposal.tokens), "verified": length})
        return [int(t) for t in proposal.tokens[:length]]

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` to the log, where one is set."""
        if self.settings.log:
            with open(self.settings.log, "a", encoding="utf-8") as log:
                log.write(json.dumps({**record, "session": self.session}) + "\n")
