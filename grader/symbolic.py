"""Symbolic equality with sympy, as the reference `symbolic_equal` does it.

Imported only inside sandbox workers: parsing and simplification can take unbounded time and memory.
Each string is parsed by the first of sympy's `parse_latex`, sympy's `parse_expr` (screened, below)
and `latex2sympy2_extended.latex2sympy` that accepts it (each tried with `\\\\` collapsed to `\\`,
then as given). A string no parser accepts is only ever compared as a string: the reference hands it
on to `N()` and `.equals()`, which `sympify` it, that is, evaluate it as Python with every builtin.
Nothing is lost for real answers: `sympify` fails on them just as `parse_expr` did.
"""

from __future__ import annotations

import builtins
import io
import tokenize
import types
from typing import Any

import sympy
from latex2sympy2_extended import latex2sympy
from sympy import N, simplify
from sympy.parsing.latex import parse_latex
from sympy.parsing.sympy_parser import parse_expr

from grader.equal import numeric_equal

# parse_expr evaluates its input as Python, in sympy's namespace plus every builtin function. A model
# output must not run code in the worker, so (a) text with string literals, attribute access, dunder
# names or `lambda` is refused (parse_expr would fail on nearly all of it anyway), and (b) the namespace
# leaves out what turns text into code or objects into text: the interpreter-facing builtins, sympy's
# printers, plotting, parsing and utilities, and sympify and its relatives. Such names then read as
# plain symbols. Real answers reach parse_expr only when parse_latex rejects them, which is rare.
_UNSAFE_BUILTINS = {
    "__import__", "ascii", "bin", "breakpoint", "chr", "compile", "delattr", "dir", "eval", "exec",
    "format", "getattr", "globals", "hasattr", "hex", "input", "locals", "oct", "open", "print", "repr",
    "setattr", "vars",
}
_UNSAFE_SYMPY_MODULES = ("sympy.printing", "sympy.interactive", "sympy.plotting", "sympy.parsing", "sympy.utilities")
_UNSAFE_SYMPY_NAMES = {"sympify", "S", "var", "symbols", "cacheit", "seterr"}


def _expr_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec("from sympy import *", namespace)  # the namespace parse_expr builds by default
    for name, obj in list(namespace.items()):
        module = getattr(obj, "__module__", None) or ""
        if name in _UNSAFE_SYMPY_NAMES or (
            callable(obj) and not isinstance(obj, (type, sympy.Basic)) and module.startswith(_UNSAFE_SYMPY_MODULES)
        ):
            del namespace[name]
    namespace["__builtins__"] = {}
    for name, obj in vars(builtins).items():
        if isinstance(obj, types.BuiltinFunctionType) and name not in _UNSAFE_BUILTINS:
            namespace[name] = obj
    namespace["max"], namespace["min"] = sympy.Max, sympy.Min
    return namespace


_NAMESPACE = _expr_namespace()
_STRING_TOKENS = {tokenize.STRING, getattr(tokenize, "FSTRING_START", tokenize.STRING)}  # f-strings: 3.12+


def _parse_expr(text: str) -> Any:
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if (
            token.type in _STRING_TOKENS
            or (token.type == tokenize.NAME and ("__" in token.string or token.string == "lambda"))
            or (token.type == tokenize.NAME and previous is not None and previous.string == ".")
        ):
            raise ValueError("refused: not a plain expression")
        previous = token
    return parse_expr(text, global_dict=dict(_NAMESPACE))


def _latex2sympy(text: str) -> Any:
    # The reference's latex2sympy2 has no token for U+2212 (the Unicode minus sign); the fork reads it
    # as "-", which would grade "− 5" equal to "-5" where the reference does not.
    if "\u2212" in text:
        raise ValueError("refused: U+2212 is no operator for the reference's latex2sympy")
    return latex2sympy(text)


def parse(text: str) -> Any:
    """The sympy object of the first parser that accepts `text`, or None when none does."""
    for parser in (parse_latex, _parse_expr, _latex2sympy):
        for candidate in (text.replace("\\\\", "\\"), text):
            try:
                return parser(candidate)
            except Exception:
                pass
    return None


def symbolic_equal(a_text: str, b_text: str) -> bool:
    """Equal as parsed expressions: same, simplifies to zero difference, equivalent equations,
    numerically close (rel 1e-4), or same-shape matrices equal after rounding to 3 decimals.
    When either side does not parse, only the reference's string comparison applies."""
    a, b = parse(a_text), parse(b_text)
    if a is None or b is None:
        return (a_text if a is None else str(a)) == (b_text if b is None else str(b))
    checks = (
        lambda: str(a) == str(b) or a == b,
        lambda: a.equals(b) or simplify(a - b) == 0,
        lambda: abs(a.lhs - a.rhs).equals(abs(b.lhs - b.rhs)),
        lambda: numeric_equal(float(N(a)), float(N(b))),
        lambda: a.shape == b.shape and a.applyfunc(lambda x: round(x, 3)).equals(b.applyfunc(lambda x: round(x, 3))),
    )
    for check in checks:
        try:
            if check():
                return True
        except Exception:
            pass
    return False

