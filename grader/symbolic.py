"""Symbolic equality with sympy, as the reference `symbolic_equal` does it.

Imported only inside sandbox workers: parsing and simplification can take unbounded time and memory.
Each string is parsed by the first of sympy's `parse_latex`, sympy's `parse_expr` and
`latex2sympy2_extended.latex2sympy` that accepts it (each tried with `\\\\` collapsed to `\\`, then
as given); a string no parser accepts stays a string.
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


def _parse(text: str) -> Any:
    for parser in (parse_latex, _parse_expr, latex2sympy):
        for candidate in (text.replace("\\\\", "\\"), text):
            try:
                return parser(candidate)
            except Exception:
                pass
    return text


def symbolic_equal(a_text: str, b_text: str) -> bool:
    """Equal as parsed expressions: same, simplifies to zero difference, equivalent equations,
    numerically close (rel 1e-4), or same-shape matrices equal after rounding to 3 decimals."""
    a, b = _parse(a_text), _parse(b_text)
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

