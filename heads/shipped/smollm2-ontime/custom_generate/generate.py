"""custom_generate/generate.py of a specheads head repo: the head drives the target's `generate` in one line.

    out = target.generate(**inputs, custom_generate="org/head", trust_remote_code=True, draft=draft,
                          max_new_tokens=256)    # greedy, or the sampling transform the head was trained for

transformers loads this file from the repo (or local folder) named by `custom_generate=` and calls its `generate`
instead of its own, with the target as `model` and generate's arguments. This adapter loads the head (safetensors and
config.json only) from that same repo and runs `specheads.integrations.transformers.speculative_generate` through
generate's own preparation: speculative decoding with `draft`, stopped by the head's exported rule (its tuned
threshold, or, when config.json carries it, `draft_while_the_next_candidate_pays` at the exported t_draft/t_target;
give yours as `cost_ratio=`). The output is the target's own distribution: greedy, token for token what
`target.generate(do_sample=False)` gives. Needs `pip install specheads` (requirements.txt beside this file).

Also taken: `assistant_model=` in place of `draft=`, `streamer=` (the prompt, then each round's tokens), `stats=[]`
(receives each row's forwards, target calls and tokens), and the loading options `revision=`, `token=`,
`cache_dir=`, `local_files_only=` ... (the head's files are fetched as this file was). `specheads export` copies
this file verbatim from `specheads/export/hub_generate.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.utils import cached_file

from specheads.heads import load_head
from specheads.integrations.transformers import generate_argument, speculative_generate
from specheads.plumbing.errors import UsageError

LOADING_KWARGS = ("revision", "token", "cache_dir", "force_download", "proxies", "local_files_only", "repo_type")
"""generate's kwargs that transformers also hands to its loader of this file: not for the model's forward."""


def loaded_from() -> str:
    """The `custom_generate=` repo id or folder of the `generate` call that loaded this file (transformers hands the
    callable generate's arguments but not that one, so it is read off generate's frame)."""
    found, source = generate_argument("custom_generate", lambda value: isinstance(value, str))
    if not found:
        raise UsageError("this head's generate.py loads the head from the repo given as generate's custom_generate=; "
                         "call target.generate(..., custom_generate='<head repo or folder>', trust_remote_code=True, "
                         "draft=draft)")
    return source


def head_folder(source: str, loading: dict[str, Any]) -> Path:
    """The folder holding `source`'s config.json and model.safetensors, fetched as transformers fetched this file
    (the same repo or folder, revision, cache, token and offline mode)."""
    try:
        config = cached_file(source, "config.json", **loading)
        cached_file(source, "model.safetensors", **loading)
    except OSError as error:
        raise UsageError(f"cannot load the head of {source}: {str(error).splitlines()[0]}; export the head with "
                         "`specheads export`, which writes config.json and model.safetensors beside custom_generate/") from None
    return Path(config).parent


def generate(model: Any, draft: Any = None, assistant_model: Any = None, streamer: Any = None,
             token_streamer: Any = None, **kwargs: Any) -> Any:
    """transformers' entry point for `custom_generate="org/head"`: speculative decoding of `model` (the target) with
    `draft` and this repo's head, through `model.generate`'s own input preparation (module docstring)."""
    if "head" in kwargs:
        raise UsageError("custom_generate='<head repo>' runs the head of that repo; drop head=, or pass "
                         "custom_generate=specheads.integrations.transformers.speculative_generate with your head=")
    if draft is not None and assistant_model is not None and draft is not assistant_model:
        raise UsageError("give the draft once: draft= or assistant_model=, not two different models")
    if streamer is not None and token_streamer is not None:
        raise UsageError("give one streamer: streamer= or token_streamer=")
    loading = {name: kwargs.pop(name) for name in LOADING_KWARGS if name in kwargs}
    head = load_head(str(head_folder(loaded_from(), loading)))
    return model.generate(custom_generate=speculative_generate, head=head,
                          draft=draft if draft is not None else assistant_model,
                          token_streamer=token_streamer if token_streamer is not None else streamer, **kwargs)
