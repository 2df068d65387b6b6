"""traces.jsonl read back: every line checked, a torn last line (a crash mid-write) dropped with a warning or
repaired, any other bad line a one-line error naming it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import orjson

from kvrescue.files import OutputFolder, open_regular, read_bounded
from kvrescue.outputs.records import Trace
from kvrescue.outputs.run_files import TRACES, RunFolderError


class TornTraceWarning(UserWarning):
    """The last traces line was cut by a crash and has been dropped."""


def read_traces(path: Path) -> list[Trace]:
    """Read traces.jsonl (a regular file; none: no traces). A torn last line is dropped with a warning; any
    other bad line, or a duplicate idx, raises `RunFolderError` naming the line."""
    if not os.path.lexists(path):
        return []
    with open_regular(path, RunFolderError) as f:
        return parse_traces(read_bounded(f, path, None, RunFolderError), path)[0]


def parse_traces(data: bytes, path: Path) -> tuple[list[Trace], bytes]:
    """The traces of traces.jsonl's bytes and its torn tail: b"" when the file ends cleanly, b"\n" when its last
    record only lost its newline (kept), else the torn bytes (dropped with a `TornTraceWarning`)."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    traces: list[Trace] = []
    seen: dict[int, int] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            raise RunFolderError(f"{path}:{no}: empty line")
        trace = _parse_line(line)
        if trace is None:
            raise RunFolderError(f"{path}:{no}: corrupt traces line (not a valid trace record)")
        if trace.idx in seen:
            raise RunFolderError(f"{path}:{no}: duplicate idx {trace.idx} (first on line {seen[trace.idx]})")
        seen[trace.idx] = no
        traces.append(trace)
    if not tail:
        return traces, b""
    trace = _parse_line(tail)
    if trace is not None and trace.idx not in seen:
        traces.append(trace)  # a complete record that only lost its newline: keep it
        return traces, b"\n"
    warnings.warn(f"{path}:{len(lines) + 1}: dropped a torn last line ({len(tail)} bytes) left by an "
                  "interrupted write", TornTraceWarning, stacklevel=3)
    return traces, tail


def repair_traces(folder: OutputFolder, size: int, tail: bytes) -> None:
    """Make traces.jsonl end cleanly after `parse_traces`: add the lost newline, or cut the torn tail."""
    fd = folder.open_file(TRACES, os.O_RDWR)
    try:
        if tail == b"\n":
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, b"\n")
        else:
            os.ftruncate(fd, size - len(tail))
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse_line(line: bytes) -> Trace | None:
    try:
        return Trace.from_dict(orjson.loads(line))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None
