"""Whether the Hugging Face Hub can be used now, decided at once: offline, a Hub id is read from the local cache or
refused in one line, instead of huggingface_hub retrying every file for about 20 s first."""

from __future__ import annotations

import functools
import os
import socket
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
TRUE_VALUES = {"1", "on", "yes", "true"}


def offline_mode() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    from_env = any(os.environ.get(name, "").strip().lower() in TRUE_VALUES for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or from_env


def hub_unreachable() -> str | None:
    """Why the Hub cannot be used now (offline mode, or no connection to its endpoint, or to the proxy that serves it,
    within PROBE_TIMEOUT_S); None when it can."""
    if offline_mode():
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants

    return _no_connection(*_hub_address(constants.ENDPOINT))


def _hub_address(endpoint: str) -> tuple[str, int]:
    """The host and port a request to `endpoint` connects to first: its proxy's when one is configured for it."""
    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get(url.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        proxied = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        return proxied.hostname or host, proxied.port or 80
    return host, url.port or (443 if url.scheme == "https" else 80)


@functools.cache
def _no_connection(host: str, port: int) -> str | None:
    """A TCP connection to host:port, tried once per process: None when it opens, else why not."""
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        return f"no connection to {host}: {error.strerror or error}"
    return None


def repo_id_shaped(name: str) -> bool:
    """Whether `name` has the shape of a Hub repo id, owner/name, and not of a path (no leading `.`, `/` or `~`)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def repo_id_problem(repo_id: str) -> str | None:
    """What the Hub's own repo-id rules find wrong with `repo_id` (None: a valid id)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return str(error).split(": '")[0].rstrip(".")
    return None


def is_hub_id(name: Any) -> bool:
    """Whether `name` reads as a Hub repo id (owner/name, valid by the Hub's rules) and names no local path."""
    return (isinstance(name, str) and repo_id_shaped(name) and repo_id_problem(name) is None
            and not Path(name).expanduser().exists())


def reach_fix() -> str:
    """How to let the Hub be reached again, for the end of a message."""
    return "unset HF_HUB_OFFLINE where there is a network" if offline_mode() else "connect to the network"
