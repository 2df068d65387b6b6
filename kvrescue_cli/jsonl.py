"""Reading JSONL input strictly: every bad line is an error naming the file and the line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO, Iterator

import orjson

from kvrescue_cli.errors import InputError


def _lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, dict]]:
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"not UTF-8 text (byte {err.start})", path=name, line=number) from None
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise InputError(f"malformed JSON ({err.msg})", path=name, line=number) from None
        if not isinstance(record, dict):
            raise InputError(f"expected a JSON object, got {type(record).__name__}", path=name, line=number)
        yield number, record


def read_jsonl(source: str | Path) -> list[tuple[int, dict]]:
    """All (line number, record) pairs of a JSONL file, or of stdin when `source` is "-"."""
    if str(source) == "-":
        return list(_lines(sys.stdin.buffer, "<stdin>"))
    path = Path(source)
    if path.is_dir():
        raise InputError("is a directory, not a JSONL file", path=path)
    if not path.is_file():
        raise InputError("no such file", path=path)
    with path.open("rb") as stream:
        return list(_lines(stream, str(path)))


def require_field(record: dict, field: str, name: str, line: int) -> object:
    """record[field], or an InputError naming the file, the line and the missing field."""
    if field not in record:
        raise InputError(f"missing field '{field}'", path=name, line=line)
    return record[field]
