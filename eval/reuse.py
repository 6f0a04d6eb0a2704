"""Taking an earlier report's decoding runs of the policies that do not read the head.

Constant K, SVIP and draft confidence (and the oracle, read off constant K_max) decode the same tokens
whichever head is evaluated: a run depends only on the models, the sampling, the decode settings, the
seed and the prompt at its position. `specheads eval --reuse_runs DIR` takes those runs from an earlier
report's `runs.json` instead of decoding them again, after checking that its decoding context is this
run's. Comparing several heads of one pair on one prompt set then costs only the head runs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from specheads.dataset.prompts import prompt_digest
from specheads.eval.sweep import DecodePrompt, RunKey, RunRecord
from specheads.plumbing.errors import UsageError

HEAD_FREE_POLICIES = ("constant_k", "svip", "confidence", "pmin")
ACCOUNTING = "counted forwards; a run ends at its first stop token"
"""How runs count what they emitted (a context field): runs of another accounting are not mixed with these. Runs
decoded before this field existed counted tokens after a stop token and a bonus token beyond max_new_tokens."""


def decoding_context(models: dict[str, Any], sampling: dict[str, Any], prompts: list[DecodePrompt],
                     max_new_tokens: int, max_draft: int, seed: int, device: str) -> dict[str, Any]:
    """Everything a head-free run's tokens depend on, as runs.json records it. `prompts` is ordered: a run's
    seed is derived from its prompt's position."""
    return {"models": models, "sampling": sampling, "max_new_tokens": max_new_tokens, "max_draft": max_draft,
            "seed": seed, "device": device, "accounting": ACCOUNTING, "prompts": [[p.prompt_id, prompt_digest(p.ids)] for p in prompts]}


def companion_context(skip_layers: list[int] | None, cost: float) -> dict[str, Any]:
    """SV's companion as a decoding context records it (`sv_companion`): which layers it skips and the cost its
    forwards are counted at, in draft forwards."""
    return {"skip_layers": None if skip_layers is None else list(skip_layers), "cost": round(cost, 6)}


def context_differences(earlier: dict[str, Any], context: dict[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
    """What besides the prompts (and the fields `ignore`) differs between an earlier decoding context and this one."""
    names = set(context) | set(earlier)
    return sorted(name for name in names if name not in ("prompts", *ignore) and earlier.get(name) != context.get(name))


def same_position_prompts(earlier: dict[str, Any], context: dict[str, Any]) -> set[str]:
    """The prompts at the same position with the same tokens in both contexts: their runs' seeds are the same."""
    return {now[0] for now, then in zip(context["prompts"], earlier.get("prompts") or []) if now == then}


def run_key(record: RunRecord) -> RunKey:
    """What identifies a run within one decoding context."""
    return record.policy, float(record.threshold), record.prompt_id


def saved_runs(folder: str, what: str, remedy: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The decoding context and the runs of the report in `folder` (its runs.json exists: EvalConfig.validate
    checks it before models load); refuses a runs.json written before it recorded its context, saying that
    `what` cannot be checked and the `remedy`."""
    path = Path(folder) / "runs.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"{path} is not readable JSON ({error}); run that eval again, or {remedy}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("runs", []), list):
        raise UsageError(f"{path} is not a `specheads eval` runs file (no list of runs); run that eval again, or {remedy}")
    if saved.get("context") is None:
        raise UsageError(f"{path} does not record its decoding context (an older specheads wrote it), so {what} "
                         f"cannot be checked; {remedy}")
    return saved["context"], saved["runs"]


def load_reusable(folder: str, context: dict[str, Any]) -> dict[RunKey, RunRecord]:
    """The head-free runs of the report in `folder` whose prompt sits at the same position in `context`,
    marked as reused; refuses a report decoded in another context, naming what differs."""
    earlier, runs = saved_runs(folder, "its runs", "drop --reuse-runs to decode them again")
    # the runs taken read no companion and no head
    differs = context_differences(earlier, context, ignore=("sv_companion", "head_forward_cost"))
    if differs:
        raise UsageError(f"{Path(folder) / 'runs.json'} was decoded with another {', '.join(differs)} than this run; reuse needs the same "
                         "models, sampling, max_new_tokens, max_draft, seed and device, so drop --reuse-runs")
    same_position = same_position_prompts(earlier, context)
    return {run_key(record): replace(record, reused=True)
            for record in read_records(runs, Path(folder) / "runs.json", "drop --reuse-runs to decode them again")
            if record.policy in HEAD_FREE_POLICIES and record.prompt_id in same_position}


def read_records(runs: list[Any], path: Path, remedy: str) -> list[RunRecord]:
    """The runs of a runs file as records; a run that is not one (a damaged or hand-edited file) is refused in one
    line naming its position."""
    records = []
    for number, row in enumerate(runs):
        try:
            records.append(RunRecord(**row))
        except TypeError as error:
            raise UsageError(f"{path}: run {number} is not a decoding run record ({error}); run that eval again, "
                             f"or {remedy}") from None
    return records
