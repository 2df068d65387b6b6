"""Bounds on a GGUF file's header, checked by walking it before any reader builds it.

gguf-py's reader (which transformers' GGUF loader uses) keeps hundreds of bytes of Python objects per metadata
value and array element, so a small (even sparse) file declaring ten million empty strings costs gigabytes. The
walk reads only lengths and counts (`struct` over a memory map) and stops at the first bound crossed. The bounds
are far above real models: a 262k-token vocabulary with its scores, types and merges is about a million elements.
The same walk hands back the integer values the loader asks for by key, so that the file is not parsed again for them.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from kvrescue.files import open_regular

MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_ARRAY_ELEMENTS = 1 << 21  # over all metadata arrays together
MAX_METADATA_BYTES = 1 << 30
MAX_NESTING = 4  # arrays of arrays
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_INTEGERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}  # GGUF value type -> struct format
_STRING, _ARRAY = 8, 9


class GGUFBoundsError(ValueError):
    """A GGUF header that is malformed or beyond the bounds; the message says which."""


class _Walk:
    def __init__(self, data: mmap.mmap, order: str) -> None:
        self.data, self.order, self.at, self.elements = data, order, 0, 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFBoundsError(f"truncated header at byte {self.at}")
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += size
        return value

    def skip(self, size: int) -> None:
        if self.at + size > min(len(self.data), MAX_METADATA_BYTES):
            raise GGUFBoundsError(f"a value at byte {self.at} runs past the file's end or the metadata bound of "
                                  f"{MAX_METADATA_BYTES} bytes")
        self.at += size

    def string(self) -> None:
        self.skip(self.take("Q"))

    def key(self) -> bytes:
        start = self.at + 8
        self.string()
        return bytes(self.data[start:self.at])

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in _SCALARS:
            self.skip(_SCALARS[kind])
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY and depth < MAX_NESTING:
            inner, count = self.take("I"), self.take("Q")
            self.elements += count
            if self.elements > MAX_ARRAY_ELEMENTS:
                raise GGUFBoundsError(f"its metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements")
            if inner in _SCALARS:
                self.skip(count * _SCALARS[inner])
            else:
                for _ in range(count):
                    self.value(inner, depth + 1)
        else:
            raise GGUFBoundsError(f"value type {kind} at byte {self.at} is not a GGUF type (or nests too deeply)")


def check_gguf_header(path: Path, wanted: tuple[str, ...] = ()) -> dict[str, int]:
    """Walk the header of the GGUF file `path`: a GGUFBoundsError when it is malformed or declares more tensors,
    keys, array elements or metadata bytes than the bounds above; else the integer values of the `wanted` keys
    that it holds."""
    found: dict[str, int] = {}
    with open_regular(path, GGUFBoundsError) as f:
        if f.read(4) != b"GGUF":
            raise GGUFBoundsError("not a GGUF file (no GGUF magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            version = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else 0
            walk = _Walk(data, "<" if version & 0xFFFF else ">")  # big-endian files read as a huge version
            walk.at = 8
            tensors, keys = walk.take("Q"), walk.take("Q")
            if tensors > MAX_TENSORS or keys > MAX_KEYS:
                raise GGUFBoundsError(f"it declares {tensors} tensors and {keys} metadata keys (at most {MAX_TENSORS} "
                                      f"and {MAX_KEYS})")
            for _ in range(keys):
                key, kind = walk.key().decode("utf-8", "replace"), walk.take("I")
                if key in wanted and kind in _INTEGERS:
                    found[key] = walk.take(_INTEGERS[kind])
                else:
                    walk.value(kind)
    return found
