"""The one error type the command line turns into a one-line message and a non-zero exit."""

from __future__ import annotations

import math
import os
from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a file, a line, a field, an option. The message is one line."""

    def __init__(self, message: str, *, path: str | Path | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment variable `name` (`default` when unset): a finite number >= 0, else an
    InputError naming the variable."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise InputError(f"${name}={text!r}: need a number of seconds >= 0")
    return value
