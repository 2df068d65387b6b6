"""Answer extraction and `strip_string` normalisation (Qwen2.5-Math `evaluation/parser.py` behaviour).

Everything here is plain string work; quirks of the reference are kept on purpose so that scores stay
comparable with published numbers (see DESIGN.md section 6 and tests/data/grader_vectors.jsonl).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from word2number import w2n

STOP_WORDS = ("</s>", "<|im_end|>", "<|endoftext|>")
CHOICES = ("A", "B", "C", "D", "E")

# Unit words (mostly from MathQA) deleted as whole tokens, in the reference's order, duplicates included.
# They are regex fragments: the '.' in entries such as "a ." matches any character.
_UNITS = [
    "east", "degree", "mph", "kmph", "ft", "m sqaure", " m east", "sq m", "deg", "mile", "q .", "monkey",
    "prime", "ratio", "profit of rs", "rd", "o", "gm", "p . m", "lb", "tile", "per", "dm", "lt", "gain",
    "ab", "way", "west", "a .", "b .", "c .", "d .", "e .", "f .", "g .", "h .", "t", "a", "h",
    "no change", "men", "soldier", "pie", "bc", "excess", "st", "inches", "noon", "percent", "by", "gal",
    "kmh", "c", "acre", "rise", "a . m", "th", "π r 2", "sq", "mark", "l", "toy", "coin", "sq . m",
    "gallon", "° f", "profit", "minw", "yr", "women", "feet", "am", "pm", "hr", "cu cm", "square",
    "v â € ™", "are", "rupee", "rounds", "cubic", "cc", "mtr", "s", "ohm", "number", "kmph", "day", "hour",
    "minute", "min", "second", "man", "woman", "sec", "cube", "mt", "sq inch", "mp", "∏ cm ³", "hectare",
    "more", "sec", "unit", "cu . m", "cm 2", "rs .", "rs", "kg", "g", "month", "km", "m", "cm", "mm",
    "apple", "liter", "loss", "yard", "pure", "year", "increase", "decrease", "d", "less", "Surface",
    "litre", "pi sq m", "s .", "metre", "meter", "inch",
]
_UNITS += [u + "s" for u in _UNITS]
# (literal text that must occur for the pattern to match, compiled pattern); the literal lets most
# patterns be skipped without running the regex.
_UNIT_PATTERNS = [(u.split(".")[0], re.compile(r"(^|\W)" + u + r"($|\W)")) for u in _UNITS]

# The reference's r"(\d+)\.0*([^\d])" and r"(\d+)\.0*$", anchored at the start of a digit run: the
# same matches, without retrying from every digit of a long run (quadratic on degenerate outputs).
_ZERO_DECIMALS_INSIDE = re.compile(r"(?<!\d)(\d+)\.0*([^\d])")
_ZERO_DECIMALS_AT_END = re.compile(r"(?<!\d)(\d+)\.0*$")
_VARIABLE_PREFIXES = ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to")
_LAST_NUMBER = re.compile(r"-?\d*\.?\d+")


def cut_at_stop_words(output: str) -> str:
    """Trim the output and cut it at the first end-of-text marker, as the harness does after generation."""
    text = output.strip()
    for stop in STOP_WORDS:
        if stop in text:
            text = text.split(stop)[0].strip()
    return text


def _brace_content(text: str) -> str:
    """Content of the `{...}` group opening `text`; everything after `{` when it never closes."""
    depth, out = 1, []
    for ch in text[1:]:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                break
        out.append(ch)
    return "".join(out)


def last_boxed(text: str) -> str:
    """What follows the last occurrence of 'boxed': a brace group, or else the text up to the next '$'."""
    tail = text.split("boxed")[-1]
    if not tail:
        return ""
    if tail[0] == "{":
        return _brace_content(tail)
    return tail.split("$")[0].strip()


def extract_answer(text: str) -> str:
    """The answer a solution states, normalised once with `strip_string`.

    Order of triggers: Minerva's "final answer is $...$. I hope", the last `boxed`, "he answer is",
    "final answer is", "答案是", and finally the last number in the text.
    """
    text = text.replace("\u043a\u0438", "")
    if "final answer is $" in text and "$. I hope" in text:
        pred = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()
    elif "boxed" in text:
        pred = last_boxed(text)
        if not pred:
            return ""
    elif "he answer is" in text:
        pred = text.split("he answer is")[-1].strip()
    elif "final answer is" in text:
        pred = text.split("final answer is")[-1].strip()
    elif "答案是" in text:
        pred = text.split("答案是")[1].strip().split("\n\n")[0].strip()
    else:
        numbers = _LAST_NUMBER.findall(text.replace(",", ""))
        pred = numbers[-1] if numbers else ""

    pred = re.sub(r"\n\s*", "", pred)
    if pred.startswith(":"):
        pred = pred[1:]
    if pred.endswith("."):
        pred = pred[:-1]
    if pred.endswith("/"):
        pred = pred[:-1]
    return strip_string(pred)


def _replace_braced(text: str, opener: str, replace: Callable[[str], str]) -> str:
    r"""`re.sub(re.escape(opener) + r"(.*?)\}", ...)` for newline-free text, in linear time: each `opener`
    up to the next "}" becomes `replace(content)`; an opener with no "}" after it is left alone."""
    out, pos = [], 0
    while (start := text.find(opener, pos)) >= 0:
        end = text.find("}", start + len(opener))
        if end < 0:
            break
        out.append(text[pos:start] + replace(text[start + len(opener) : end]))
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def _fix_fracs(text: str) -> str:
    r"""Brace single-character `\frac` arguments: `\frac12` -> `\frac{1}{2}`, `\frac1{72}` -> `\frac{1}{72}`."""
    head, *pieces = text.split("\\frac")
    out = [head]
    for piece in pieces:
        out.append("\\frac")
        if piece.startswith("{"):
            out.append(piece)
            continue
        if len(piece) < 2:
            return text
        a, b, rest = piece[0], piece[1], piece[2:]
        out.append("{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest)
    return "".join(out)


def _fix_a_slash_b(text: str) -> str:
    r"""`a/b` with integer parts (or parts containing `sqrt`) -> `\frac{a}{b}`, when it round-trips exactly."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a, b = (p if "sqrt" in p else str(int(p)) for p in parts)
    except ValueError:
        return text
    if text != f"{a}/{b}":
        return text
    return "\\frac{" + a + "}{" + b + "}"


def _word_to_number(text: str) -> str:
    try:
        return str(w2n.word_to_num(text))
    except Exception:  # word2number raises ValueError, and others on odd input
        return text


def _remove_units(text: str) -> str:
    """Two passes over the unit list; a deletion that would leave nothing is not applied."""
    for _ in range(2):
        for literal, pattern in _UNIT_PATTERNS:
            if literal in text:
                stripped = pattern.sub(r"\1\2", text)
                if stripped:
                    text = stripped
    return text


def strip_string(text: str) -> str:
    """Normalise an answer string the way the reference `strip_string` does (units always removed)."""
    s = str(text).strip().replace("\n", "").rstrip(".")
    s = s.replace("\\!", "")
    s = _replace_braced(s, "\\begin{array}{", lambda _: "\\begin{pmatrix}")
    s = re.sub(r"\\end\{array\}", r"\\end{pmatrix}", s)
    s = s.replace("bmatrix", "pmatrix")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\neq", "\\ne").replace("\\leq", "\\le").replace("\\geq", "\\ge")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\{", "{").replace("\\}", "}")

    # A trailing \text{...} is taken for a unit: everything from the first \text{ goes when the string
    # ends with "}", unless nothing would be left.
    first_text = s.find("\\text{")
    without_text = s[:first_text].strip() if first_text >= 0 and s.endswith("}") else s.strip()
    if without_text:
        s = without_text
    s = _remove_units(s)

    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\(", "").replace("\\)", "")
    s = _word_to_number(s)
    s = _replace_braced(s, "\\text{", lambda content: content)
    for prefix in _VARIABLE_PREFIXES:
        s = s.replace(prefix, "")
    s = s.replace("\\emptyset", "{}")
    s = s.replace("(-\\infty,\\infty)", "\\mathbb{R}")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    # (The reference also unwraps "{x}"/"(x)"/"[x]" when the whole string is alphanumeric, which can
    # never hold for a bracketed string, and "removes" quotes without keeping the result: both no-ops.)

    s = s.replace("infinity", "\\infty")
    if "\\infty" not in s:
        s = s.replace("inf", "\\infty")
    s = s.replace("+\\inity", "\\infty")
    s = s.replace("and", "").replace("\\mathbf", "")
    s = _replace_braced(s, "\\mbox{", lambda _: "")
    if "j" in s and "i" not in s:
        s = s.replace("j", "i")
    # Drop zero decimals: "3.0" -> "3", "2.00x" -> "2x".
    s = _ZERO_DECIMALS_INSIDE.sub(r"\1\2", s)
    s = _ZERO_DECIMALS_AT_END.sub(r"\1", s)

    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    # A short left-hand side ("k = 3", "y =2x") is dropped.
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = re.sub(r"\\sqrt(\w+)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    return _fix_a_slash_b(s)


def choice_answer_clean(text: str) -> str:
    """Pick a choice letter out of a whole output (the harness's re-extraction for lettered answers).

    After an "answer is"/"choice is" trigger the first letter wins, otherwise the last one; text with
    several triggers is treated as few-shot and cut at its first blank line.
    """
    text = text.strip("\n")
    triggers = ("choice is", "answer is")
    if any(text.count(t) > 1 for t in triggers):
        text = text.split("\n\n")[0]
    pieces = re.split("|".join(triggers), text)
    after_trigger = len(pieces) > 1
    if after_trigger:
        text = pieces[-1]
    text = text.strip("\n").rstrip(".").rstrip("/").strip(" ").lstrip(":")
    letters = re.findall(r"\b(A|B|C|D|E)\b", text.upper()) or [text.strip().strip(".")]
    pick = letters[0] if after_trigger else letters[-1]
    return pick.rstrip(".").rstrip("/")


def is_choice_string(text: str) -> bool:
    """True when every character is a choice letter (vacuously true for the empty string)."""
    return all(c in CHOICES for c in text)


def prediction(output: str, gt_norm: str) -> str:
    """The normalised prediction for a model output, given the normalised ground truth.

    Cut at stop words, extract, `strip_string` again; then the harness's lettered-answer fix-ups: for a
    single-letter gt a non-letter prediction is re-read from the whole output, and for an all-letter gt
    (including an empty one) non-letters are dropped from the prediction.
    """
    text = cut_at_stop_words(output)
    pred = strip_string(extract_answer(text))
    if gt_norm in CHOICES and pred not in CHOICES:
        pred = choice_answer_clean(text)
    elif is_choice_string(gt_norm) and not is_choice_string(pred):
        pred = "".join(c for c in pred if c in CHOICES)
    return pred
