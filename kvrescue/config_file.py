"""`kvrescue run --config FILE.toml`: a grid's options in one reviewable file.

Top-level keys are `run` options by their long name without the dashes (`problem-field`; `problem_field`
too), with the option's own type; the grid's axes (bench, method, budget, n, seed) take a list or one value.
Each `[[grid]]` table is one more grid over the same models and settings, giving axes only; the run executes
the union of their cells. Options given on the command line override the file.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrescue.errors import InputError

MAX_BYTES = 1 << 20  # a grid file is a page of options
# tomllib's time and memory grow with the square of a dotted key's parts (80 kB of `a.a.a...`: a minute and
# gigabytes), and its recursion with nesting; a grid file's keys are plain names and its values flat lists
MAX_KEY_PARTS = 8
MAX_NESTING = 16
_STRINGS = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'', re.S)
_COMMENTS = re.compile(r"#[^\n]*")
_DOTTED = re.compile(r"[\w-]+(?:[ \t]*\.[ \t]*[\w-]+){%d,}" % MAX_KEY_PARTS)
AXES = {"bench": str, "method": str, "budget": int, "n": int, "seed": int}


@dataclass(frozen=True)
class GridFile:
    """What a grid file holds: option values by parameter name (axes as comma lists), and its `[[grid]]` axes."""

    path: Path
    options: dict[str, Any]
    grids: list[dict[str, str]]


def read_grid_file(path: Path, kinds: dict[str, type], keys: dict[str, str]) -> GridFile:
    """Parse and type-check `path`; `kinds`: each parameter's type, `keys`: every accepted key -> its parameter."""
    data = _load(path)
    grids = data.pop("grid", [])
    if not isinstance(grids, list) or not all(isinstance(g, dict) for g in grids):
        raise InputError(f"{path}: key 'grid': expected [[grid]] tables")
    options = _table(path, data, kinds, keys, "")
    tables = [_table(path, g, kinds, keys, f"[[grid]] {i + 1}: ") for i, g in enumerate(grids)]
    for i, table in enumerate(tables):
        other = sorted(set(table) - set(AXES))
        if other:
            raise InputError(f"{path}: [[grid]] {i + 1}: key '{other[0]}': a [[grid]] gives only the axes "
                             f"{', '.join(AXES)}; put other options at the top level")
    return GridFile(path, options, tables)


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InputError(f"--config {path}: not a regular file")
    with path.open("rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise InputError(f"--config {path}: larger than {MAX_BYTES} bytes; a grid file is a page of options")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not valid TOML: {err}") from None
    shape = _shape_error(text)
    if shape:
        raise InputError(f"{path}: {shape}; a grid file holds plain keys and flat lists")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{path}: not valid TOML: {err}") from None


def _shape_error(text: str) -> str | None:
    """What in `text` is beyond a grid file's shape (a key of more than MAX_KEY_PARTS dotted parts, brackets and
    braces nested deeper than MAX_NESTING), read outside strings and comments before tomllib sees it; or None."""
    bare = _COMMENTS.sub("", _STRINGS.sub("s", text))
    dotted = _DOTTED.search(bare)
    if dotted:
        return f"a dotted key of more than {MAX_KEY_PARTS} parts ({dotted.group()[:40]}...)"
    depth = deepest = 0
    for char in bare:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_NESTING:
                return f"brackets or braces nested more than {MAX_NESTING} deep"
        elif char in "]}":
            depth -= 1
    return None


def _table(path: Path, table: dict[str, Any], kinds: dict[str, type], keys: dict[str, str],
           where: str) -> dict[str, Any]:
    """{parameter: value as the command line takes it} of one table, every key known, typed and given once."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in table.items():
        name = keys.get(key)
        if name is None:
            raise InputError(f"{path}: {where}unknown key '{key}' (keys are `kvrescue run` options without the "
                             "dashes, e.g. problem-field)")
        if name in given:
            raise InputError(f"{path}: {where}key '{key}' conflicts with key '{given[name]}': both set --"
                             f"{name.replace('_', '-')}")
        given[name] = key
        out[name] = _value(path, where, key, value, AXES.get(name), kinds[name])
    return out


def _value(path: Path, where: str, key: str, value: Any, axis: type | None, kind: type) -> Any:
    def wrong(expected: str) -> InputError:
        return InputError(f"{path}: {where}key '{key}': expected {expected}, got {type(value).__name__} {value!r}")

    if axis is not None:
        items = value if isinstance(value, list) else [value]
        if not items or not all(_is(v, axis) for v in items):
            raise wrong(f"{'an integer' if axis is int else 'a string'} or a non-empty list of them")
        return ",".join(map(str, items))
    if not _is(value, kind):
        raise wrong({bool: "true or false", int: "an integer", float: "a number"}.get(kind, "a string"))
    return str(value) if kind is Path else value


def _is(value: Any, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, str if kind is Path else kind)
