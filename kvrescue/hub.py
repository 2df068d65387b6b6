"""The Hugging Face Hub as kvrescue reaches it.

- `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set: no request at all; the local Hugging Face cache, else the
  config.json files shipped in `hub_configs/`.
- Otherwise one probe of the endpoint per process, before the first request: a machine without the Hub gets a
  one-line answer at once, not the client's retries for every file (the process is then offline, as if
  HF_HUB_OFFLINE were set).
- Each model's config.json is fetched once per process (its bytes and the commit they resolve to).
- `--base-revision` and the others pin a model's revision for every Hub request of this process (`pin`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

PROBE_TIMEOUT_S = 5.0
SHIPPED = Path(__file__).with_name("hub_configs")  # <owner>--<name>.json: exact copies of Hub config.json files
_pinned: dict[str, str] = {}  # Hub id -> the revision this process uses
_dropped: str | None = None  # why this process stopped asking the Hub: its probe failed


class HubError(RuntimeError):
    """A Hub file that can't be had; the message is one line."""


def pin(revisions: Mapping[str, str]) -> None:
    """Use these revisions (Hub id -> branch, tag or commit) for every Hub request of this process, the others' main
    branch."""
    _pinned.clear()
    _pinned.update(revisions)
    config_file.cache_clear()


def revision_of(model: str) -> str | None:
    """The revision pinned for a Hub id, None for its default branch."""
    return _pinned.get(model)


def unreachable() -> str | None:
    """Why the Hub can't be reached from this process, or None: no request where HF_HUB_OFFLINE is set, else the
    answer of this process's one probe."""
    from huggingface_hub import constants

    if _dropped:
        return _dropped
    return "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else _probe()


@functools.cache
def _probe() -> str | None:
    """One HEAD request to the Hub's endpoint through the Hub client's own session (its proxies and certificates),
    without retries: any HTTP answer means it is reachable; else why not."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # the client's network stack raises many kinds (refused, reset, DNS, TLS, timeouts)
        reason = _first_line(e)
        # The rest of this process and the processes it starts (Ray workers, vLLM's engines) stay off the Hub: the
        # client then reads its cache at once instead of retrying (its own requests, such as its registry of
        # agent harnesses, included).
        global _dropped
        _dropped = f"{constants.ENDPOINT} did not answer: {reason}"
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
        return _dropped
    return None


@functools.cache
def config_file(model: str) -> tuple[bytes, str | None]:
    """A Hub model's config.json and the commit it was read at (None: the copy shipped in `hub_configs/`): from the
    Hub when it is reachable, else from the local Hugging Face cache, else the shipped copy; HubError otherwise."""
    from huggingface_hub import hf_hub_download

    why = unreachable()
    revision = revision_of(model)
    try:
        path = Path(hf_hub_download(model, "config.json", revision=revision, local_files_only=why is not None))
        return path.read_bytes(), path.parent.name
    except Exception as e:  # the Hub client raises many kinds (404, gated, not cached, timeouts)
        if why is None:
            raise HubError(f"could not fetch config.json from the Hugging Face Hub ({_first_line(e)})") from None
    shipped = SHIPPED / f"{model.replace('/', '--')}.json"
    if revision is None and shipped.is_file():
        return shipped.read_bytes(), None
    raise HubError(f"config.json is not in the local Hugging Face cache and the Hub can't be reached ({why})")


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
