"""The explorer as one self-contained HTML file: template, style and script inline, data gzip-compressed.

The data travels base64-encoded inside a `<script type="application/octet-stream">` element (so nothing in
a model's output can close the script or inject markup) and is unpacked in the browser with the built-in
`DecompressionStream`. A Content-Security-Policy forbids every network request.
"""

from __future__ import annotations

import base64
import gzip
import html
import re
from importlib.resources import files
from typing import Any

import orjson

TEMPLATE_FILES = ("page.html", "page.css", "page.js")


def _template(name: str) -> str:
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def packed(data: Any) -> str:
    """JSON, gzip-compressed (deterministic: no timestamp), base64-encoded."""
    return base64.b64encode(gzip.compress(orjson.dumps(data), compresslevel=9, mtime=0)).decode("ascii")


def render(data: Any, title: str) -> str:
    """The whole page for `data` (see `view.data.page_data`)."""
    page, style, script = (_template(name) for name in TEMPLATE_FILES)
    parts = {"title": html.escape(title), "style": style, "script": script, "data": packed(data)}
    return re.sub(r"\{\{(title|style|script|data)\}\}", lambda m: parts[m.group(1)], page)
