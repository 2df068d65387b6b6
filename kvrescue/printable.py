"""Text from run folders and model outputs made safe to print: no terminal escapes, no spreadsheet formulas."""

from __future__ import annotations

import unicodedata

FORMULA_PREFIXES = ("=", "+", "-", "@")  # what a spreadsheet reads as the start of a formula (tab, CR: escaped)


def printable(text: str) -> str:
    """`text` with every control or format character (ESC, CR, BEL, bidi overrides, ...) shown as an escape such as
    `\\x1b`, so that a folder name or an output cannot move the cursor, recolour or rewrite the terminal."""
    return "".join(ch if unicodedata.category(ch) not in ("Cc", "Cf") else ascii(ch)[1:-1] for ch in text)


def csv_text(text: str) -> str:
    """A text cell for a CSV: `printable`, and a leading `'` where a spreadsheet would read a formula."""
    text = printable(text)
    return "'" + text if text.startswith(FORMULA_PREFIXES) else text
