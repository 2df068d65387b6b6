"""The one error type the command line turns into a one-line message and a non-zero exit."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a file, a line, a field, an option. The message is one line."""

    def __init__(self, message: str, *, path: str | Path | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
