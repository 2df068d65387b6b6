"""What the commands share: the two consoles, one-line errors, output-file checks, comma lists and byte sizes."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from kvrescue.errors import InputError
from kvrescue.files import kind, write_file_atomic

console = Console(stderr=True)  # progress, logs, errors
stdout = Console()  # the product of report, bench and cost


def fit_consoles() -> None:
    """A terminal's width, or $COLUMNS; logs and pipes without $COLUMNS get whole tables (200 columns)."""
    for each in (console, stdout):
        each.width = None if each.file.isatty() or "COLUMNS" in os.environ else 200


def fail(err: InputError) -> NoReturn:
    """`error: <message>` on stderr and exit status 2, never a traceback."""
    console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2) from None


def one_line_errors(command: Callable) -> Callable:
    """Turn InputError into a one-line error (`fail`)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except InputError as err:
            fail(err)

    return wrapper


GRADER_HELP = "qwen (the Qwen2.5-Math grader logic, the paper's) or math-verify (Hugging Face's Math-Verify, an extra)"
K_HELP = "k of pass@k and maj@k over seeds (comma list; those above a row's seeds are left out)"

DEFAULT_MODELS = {
    "base": "Qwen/Qwen2.5-Math-7B-Instruct",
    "helper": "Qwen/Qwen2.5-Math-1.5B-Instruct",
    "prm": "Qwen/Qwen2.5-Math-PRM-7B",
}



def check_output_file(out: Path | None, option: str) -> None:
    """Refuse, before any work, an output path that can't become a file."""
    if out is None:
        return
    if out.is_dir():
        raise InputError(f"{option} {out}: is a directory, not a file")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise InputError(f"{option} {out}: is {kind(out.lstat().st_mode)}; kvrescue writes only regular files")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InputError(f"{option} {out}: {parent} is a file, not a folder")


def png_path(path: Path, option: str) -> Path:
    """The PNG file an option names (`.png` added when it has no suffix); one-line errors for the rest."""
    if path.is_dir():
        raise InputError(f"{option} {path}: is a directory, not a file")
    if not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise InputError(f"{option} {path}: the plot is written as PNG; name a .png file")
    check_output_file(path, option)
    return path


def write_jsonl_atomically(records: list[dict], out: Path | None) -> None:
    """JSONL to stdout, or to `out` through a temporary file renamed at the end (never half-written)."""
    from kvrescue.jsonl import dumps_line

    payload = b"".join(dumps_line(record) for record in records)
    if out is None:
        sys.stdout.buffer.write(payload)
        sys.stdout.buffer.flush()
        return
    write_file_atomic(out, payload)



def comma_list(value: str, cast: Callable = str, option: str = "") -> list:
    try:
        items = [cast(part.strip()) for part in value.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{option} {value!r}: expected a comma list of {cast.__name__}") from None
    if not items:
        raise InputError(f"{option} is empty")
    return items


def parse_ks(value: str) -> list[int]:
    """--k: the k of pass@k and maj@k, positive integers."""
    ks = comma_list(value, int, "--k")
    if any(k < 1 for k in ks):
        raise InputError(f"--k {value!r}: every k must be a positive integer")
    return sorted(set(ks))



BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: str, option: str) -> int:
    """'80GiB', '40 GB', '1e9B' -> bytes; a one-line error for anything else, a bare number too (bytes? GiB?)."""
    text = value.strip().upper()
    number = text.rstrip("KMGTIB ")
    unit = text[len(number):].strip()
    try:
        size = float(number) * BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise InputError(f"{option} {value!r}: expected a size with its unit, such as 80GiB, 40GB or 1e9B") from None
    if not 1 <= size < 1 << 63:
        raise InputError(f"{option} {value!r}: need a positive size below 8 EiB")
    return int(size)

