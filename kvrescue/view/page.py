"""The explorer as one self-contained HTML file: template, style and script inline, data gzip-compressed.

KaTeX (vendored in katex/ by scripts/vendor_katex.sh) comes inline too: its script as a second inline script,
its style with the woff2 fonts as data: URIs, so the page still makes no request and opens from disk.

Each packed piece travels base64-encoded inside a `<script type="application/octet-stream">` element (so
nothing in a model's output can close the script or inject markup) and is unpacked in the browser with the
built-in `DecompressionStream`: the index when the page opens, a run's detail chunk when a problem page needs
it. A Content-Security-Policy forbids every network request, forms and `<base>`, and runs no script but the page's
own (KaTeX's and the page's, each named by its SHA-256: text injected into the page could not run even if it
escaped its element).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import re
from functools import cache
from importlib.resources import files
from typing import Any

import orjson

TEMPLATE_FILES = ("page.html", "page.css", "page.js")
KATEX_FONT = re.compile(r"src:url\(fonts/([\w-]+)\.woff2\) format\(\"woff2\"\)[^;}]*")


def _template(name: str) -> str:
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


@cache
def katex_style() -> str:
    """KaTeX's stylesheet, each font face's sources replaced by its woff2 font as a data: URI."""
    folder = files(__package__).joinpath("katex")

    def inline(m: re.Match[str]) -> str:
        font = base64.b64encode(folder.joinpath("fonts", m.group(1) + ".woff2").read_bytes()).decode("ascii")
        return f'src:url(data:font/woff2;base64,{font}) format("woff2")'

    style, count = KATEX_FONT.subn(inline, folder.joinpath("katex.min.css").read_text(encoding="utf-8"))
    if count != style.count("@font-face"):
        raise RuntimeError("katex.min.css: a font face without a woff2 source (re-run scripts/vendor_katex.sh)")
    return style


def packed(data: Any) -> str:
    """JSON, gzip-compressed (level 6: level 9 is much slower for a few percent; no timestamp), base64-encoded."""
    return base64.b64encode(gzip.compress(orjson.dumps(data), compresslevel=6, mtime=0)).decode("ascii")


def render(index: Any, details: list[dict[int, Any]], title: str) -> str:
    """The whole page: `index` (see `view.data.page_data`) and, per run, its detail chunks by number."""
    page, style, script = (_template(name) for name in TEMPLATE_FILES)
    katex = _template("katex/katex.min.js")
    if re.search(r"</script|<!--", katex, flags=re.I):  # either would end or garble its inline <script>
        raise RuntimeError("katex.min.js cannot be inlined as it is (re-run scripts/vendor_katex.sh)")
    chunks = "\n".join(f'<script type="application/octet-stream" id="kv-run-{run}-{number}">{packed(chunk)}</script>'
                       for run, by_number in enumerate(details) for number, chunk in by_number.items())
    parts = {"title": html.escape(title), "katex_style": katex_style(), "style": style, "katex": katex,
             "script": script, "script_hashes": f"'sha256-{script_hash(katex)}' 'sha256-{script_hash(script)}'",
             "data": packed(index), "details": chunks}
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], page)


def script_hash(script: str) -> str:
    """The CSP source hash of an inline script: base64 of the SHA-256 of its text (UTF-8)."""
    return base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
