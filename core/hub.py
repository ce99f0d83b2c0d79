"""Is the Hugging Face Hub there? One quick probe per process, and offline mode switched on for
the rest of it when the Hub does not answer, so that no loader waits on timeouts and retries."""

from __future__ import annotations

import functools
import os
import socket
import sys

HUB_PROBE_S = 2.0  # how long the one reachability check may take
_TRUE = ("1", "ON", "YES", "TRUE")


def _offline_set() -> bool:
    """HF_HUB_OFFLINE=1 in the environment, or set on huggingface_hub since it was imported."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        return True
    constants = sys.modules.get("huggingface_hub.constants")
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


@functools.cache
def hub_reachable(timeout: float = HUB_PROBE_S) -> bool:
    """One TCP connect to the Hub (HF_ENDPOINT), or to the HTTPS proxy when one is set, that
    may take `timeout` seconds, DNS included (it runs in a thread that is not waited for
    longer). Checked once per process."""
    import threading
    import urllib.parse

    target = next(
        (
            os.environ[k]
            for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
            if os.environ.get(k)
        ),
        os.environ.get("HF_ENDPOINT", "https://huggingface.co"),
    )
    try:
        url = urllib.parse.urlsplit(target if "//" in target else f"//{target}")
        port = url.port or (80 if url.scheme == "http" else 443)
    except ValueError:  # a malformed endpoint: nothing could reach it
        return False
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname or "", port), timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, name="semix-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answer and answer[0])


def hub_offline() -> bool:
    """True when models must come from the local cache: HF_HUB_OFFLINE=1, or the Hub does not
    answer one quick connect (`hub_reachable`). Then offline mode is switched on for the rest
    of the process and its children (HF_HUB_OFFLINE=1, and huggingface_hub's flag if it is
    imported), so no loader waits on timeouts and retries; loaders also pass
    `local_files_only=True`, and a model that is not cached fails at once, in one line."""
    if _offline_set():
        return True
    if hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    return True
