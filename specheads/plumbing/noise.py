"""Third-party noise kept out of the user's terminal: framework tips and info logs, warnings, loading bars.

`specheads.cli.main` runs every subcommand inside `third_party_quiet()` unless `--debug` or SPECHEADS_DEBUG=1 asks
for everything. What specheads itself prints (summaries, `--progress` bars, error lines) is untouched: it reports
through its own lines, never through `warnings` or `logging`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

_quiet = False


@contextlib.contextmanager
def third_party_quiet() -> Iterator[None]:
    """Silence, until the block ends: every warning not raised by specheads, every log record below WARNING
    (Lightning's "💡 Tip", device and seed lines), transformers' warnings and its own progress bars ("Loading
    weights")."""
    global _quiet
    was_quiet, disabled_below = _quiet, logging.root.manager.disable
    restore_transformers = _quiet_transformers()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        warnings.filterwarnings("default", module=r"specheads(\.|$)")
        logging.disable(logging.INFO)
        _quiet = True
        try:
            yield
        finally:
            _quiet = was_quiet
            logging.disable(disabled_below)
            restore_transformers()


@contextlib.contextmanager
def stderr_hidden_when_quiet() -> Iterator[None]:
    """Inside `third_party_quiet`, swallow what a library writes to stderr with no switch to stop it (transformers'
    GGUF conversion bar); outside it, let everything through."""
    with contextlib.redirect_stderr(io.StringIO()) if _quiet else contextlib.nullcontext():
        yield


def _disabled_bar(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return factory(*args, **{**kwargs, "disable": True})


def _quiet_transformers() -> Callable[[], None]:
    """transformers' warnings (generation-config advice) and own bars off, not huggingface_hub's download bars;
    returns what restores them."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    set_hook = getattr(transformers_logging, "set_tqdm_hook", None)  # transformers 5.x; older: its bars stay
    previous_hook = set_hook(_disabled_bar) if set_hook else None

    def restore() -> None:
        transformers_logging.set_verbosity(verbosity)
        if set_hook:
            set_hook(previous_hook)

    return restore
