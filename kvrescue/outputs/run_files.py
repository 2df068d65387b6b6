"""A run folder's files: their names, the one error type for them, atomic writes and bounded JSON reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from kvrescue.errors import InputError
from kvrescue.files import CONFIG_LIMIT, read_regular, write_file_atomic

FORMAT = 1
CONFIG, TRACES, SUMMARY, LOCK = "config.json", "traces.jsonl", "summary.json", ".lock"


class RunFolderError(InputError):
    """A run folder problem that the user must fix; the message is one line."""


def write_atomic(path: Path, payload: bytes) -> None:
    """Write one file atomically (`files.write_file_atomic`: a regular file or absent, never through a link)."""
    write_file_atomic(path, payload, RunFolderError)


def json_bytes(data: Any) -> bytes:
    """Indented JSON as config.json and summary.json hold it."""
    return orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON atomically (`write_atomic`)."""
    write_atomic(path, json_bytes(data))


def parse_json(data: bytes, path: Path) -> Any:
    """JSON of a run folder's file; invalid JSON is a one-line `RunFolderError`."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RunFolderError(f"{path}: not valid JSON ({e})") from None


def read_json(path: Path) -> Any:
    """Read a JSON file (a regular file of at most `CONFIG_LIMIT` bytes); anything else is a one-line
    `RunFolderError`."""
    if not os.path.lexists(path):
        raise RunFolderError(f"{path}: missing")
    return parse_json(read_regular(path, CONFIG_LIMIT, RunFolderError), path)
