"""JSONL records in and out, strictly and exactly: every bad line is an error naming the file and the line, and
every value passes through unchanged (integers of any size included, which orjson alone would turn into floats
or refuse to write)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import IO, Any, Iterator

import orjson

from kvrescue.errors import InputError
from kvrescue.files import open_regular

MAX_DEPTH = 254  # nesting levels orjson writes (the record itself is the first)
_LONG_DIGITS = re.compile(rb"\d{19}")  # any integer outside orjson's 64 bits has at least 19 digits


class IntegerTooLong(ValueError):
    """A JSON integer with more digits than Python converts (`sys.get_int_max_str_digits`, 4,300 by default: its
    guard against conversions that take quadratic time)."""


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parse_int(text: str) -> int:
    digits, limit = len(text.lstrip("-")), sys.get_int_max_str_digits()
    if limit and digits > limit:
        raise IntegerTooLong(f"an integer of {digits} digits, more than the {limit} Python converts (its guard "
                             "against slow conversions); give it as a string")
    return int(text)


def loads_exact(raw: bytes) -> Any:
    """JSON of one line, integers exact: orjson, or the standard library's parser where a number may be an
    integer beyond 64 bits. Raises ValueError (orjson.JSONDecodeError is one) for anything but JSON."""
    if not _LONG_DIGITS.search(raw):
        return orjson.loads(raw)
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None


def dumps_exact(data: Any, indent: bool = False) -> bytes:
    """JSON text of `data` exactly, newline included (indented by 2 when `indent`): orjson, or the standard
    library's writer for data holding an integer beyond 64 bits."""
    try:
        return orjson.dumps(data, option=orjson.OPT_INDENT_2 if indent else 0) + b"\n"
    except TypeError:
        layout = {"indent": 2} if indent else {"separators": (",", ":")}
        return json.dumps(data, ensure_ascii=False, allow_nan=False, **layout).encode("utf-8") + b"\n"


def dumps_line(record: Any) -> bytes:
    """One JSONL line (newline included) holding `record` exactly (`dumps_exact`)."""
    return dumps_exact(record)


def depth(value: Any) -> int:
    """How many levels of lists and objects `value` nests (0 for a string or number), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def _lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, dict]]:
    for number, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"not UTF-8 text (byte {err.start})", path=name, line=number) from None
        try:
            record = loads_exact(raw)
        except orjson.JSONDecodeError as err:
            raise InputError(f"malformed JSON ({err.msg})", path=name, line=number) from None
        except IntegerTooLong as err:
            raise InputError(str(err), path=name, line=number) from None
        except ValueError as err:
            raise InputError(f"malformed JSON ({err})", path=name, line=number) from None
        if not isinstance(record, dict):
            raise InputError(f"expected a JSON object, got {type(record).__name__}", path=name, line=number)
        if depth(record) > MAX_DEPTH:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels", path=name, line=number)
        yield number, record


def read_jsonl(source: str | Path) -> list[tuple[int, dict]]:
    """All (line number, record) pairs of a JSONL file (a regular file), or of stdin when `source` is "-"."""
    if str(source) == "-":
        return list(_lines(sys.stdin.buffer, "<stdin>"))
    with open_regular(source, what="a JSONL file") as stream:
        try:
            return list(_lines(stream, str(source)))
        except OSError as e:
            raise InputError(f"cannot read ({e.strerror})", path=source) from None


def require_field(record: dict, field: str, name: str, line: int) -> object:
    """record[field], or an InputError naming the file, the line and the missing field."""
    if field not in record:
        raise InputError(f"missing field '{field}'", path=name, line=line)
    return record[field]
