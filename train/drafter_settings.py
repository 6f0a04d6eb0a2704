"""The checks `specheads train drafter` makes of its settings before the data step (the ones a type cannot say, as
they relate two settings, or a setting to the target or the prompts), and of a run folder it resumes: the settings
it was started with, recorded in `settings.json`, must be the ones given now."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specheads.dataset.prompts import Prompt, encode_prompt
from specheads.plumbing.errors import UsageError
from specheads.plumbing.files import write_json_atomic

SETTINGS = "settings.json"
"""The run folder's record of the settings it was started with (`check_resumed_settings`)."""
FREE_ON_RESUME = ("out", "max_steps", "val_every", "checkpoint_every", "accelerator")
"""Settings a resumed run may change: where it is, how long it trains on (the way to train further), how often it
evaluates and saves, and the device; every other one changes what the run computes."""


def held_out(prompt_id: str, fraction: float) -> bool:
    """Whether a prompt is held out: a hash of its id, so the split never depends on order or count."""
    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) < fraction * 16**8


def check_split(prompts: list[Prompt], fraction: float) -> None:
    """Refuse a `--val-fraction` that holds out none of the prompts, or all of them (every prompt gives sequences,
    so the split of the sequences is the split of the prompts)."""
    held = sum(held_out(prompt.id, fraction) for prompt in prompts)
    if not held or held == len(prompts):
        raise UsageError(f"--val-fraction {fraction} holds out {held} of the {len(prompts)} prompts, leaving "
                         f"{'no held-out' if not held else 'no training'} data; give more prompts or a fraction "
                         f"{'above' if not held else 'below'} that")


def check_sizes(config: Any, target_config: Any, tokenizer: Any, prompts: list[Prompt]) -> None:
    """Refuse sizes with no use and no bound: responses past the target's context, a DSpark block longer than the
    longest response or a step's batch, a Markov bias of a rank above the draft vocabulary's."""
    context = int(getattr(target_config, "max_position_embeddings", None) or 1 << 30)
    longest = max(len(encode_prompt(tokenizer, prompt)) for prompt in prompts)
    if longest + config.max_new_tokens > context:
        raise UsageError(f"--max-new-tokens {config.max_new_tokens} after the longest prompt ({longest} tokens) runs "
                         f"past the target's context ({context} positions); give at most {max(context - longest, 0)}")
    if config.algorithm != "dspark":
        return
    room = min(config.max_new_tokens, config.tokens_per_batch)
    if config.block_size > room:
        raise UsageError(f"--block-size {config.block_size} is longer than any response (--max-new-tokens "
                         f"{config.max_new_tokens}) or a step's batch (--tokens-per-batch {config.tokens_per_batch}); "
                         f"give at most {room}")
    if config.markov_rank > config.draft_vocab_size:
        raise UsageError(f"--markov-rank {config.markov_rank} exceeds the draft vocabulary ({config.draft_vocab_size}), "
                         "the most a Markov bias's rank can use; give at most that")


def flat_settings(config: Any) -> dict[str, Any]:
    """The config's settings by dotted name (`target.path`), as JSON reads them back."""
    return flat_settings_of(json.loads(json.dumps(asdict(config))))


def recorded_settings(out: Path) -> dict[str, Any] | None:
    """The settings a run in `out` was started with: its settings.json, or the config of a fingerprint.json written
    before settings.json was; None for a new run."""
    if (out / SETTINGS).is_file():
        return json.loads((out / SETTINGS).read_text())
    if (out / "fingerprint.json").is_file():
        config = json.loads((out / "fingerprint.json").read_text()).get("config")
        return flat_settings_of(config) if isinstance(config, dict) else None
    return None


def flat_settings_of(values: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (nested) by dotted name."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        flat.update({f"{key}.{k}": v for k, v in flat_settings_of(value).items()} if isinstance(value, dict)
                    else {key: value})
    return flat


def check_resumed_settings(out: Path, config: Any) -> None:
    """Refuse to resume the run in `out` under settings other than those it was started with (naming the first that
    differs), apart from `FREE_ON_RESUME`; record the settings of a new run."""
    now = flat_settings(config)
    before = recorded_settings(out)
    if before is None:
        write_json_atomic(out / SETTINGS, now)
        return
    for name in [*now, *(name for name in before if name not in now)]:  # the first in the config's order
        if name.split(".")[0] not in FREE_ON_RESUME and now.get(name) != before.get(name):
            flag = "--" + (name if "." in name else name.replace("_", "-"))
            raise UsageError(f"{out} holds a run made with other settings ({name}): {flag} was "
                             f"{json.dumps(before.get(name))}, now {json.dumps(now.get(name))}; give the same settings "
                             "to resume it, or a new --out to start another run")
