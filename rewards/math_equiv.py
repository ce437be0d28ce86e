"""Numeric and symbolic answer equivalence with sympy, safe on model-written strings.

sympy's parser evaluates Python, so answers are screened first: a small character set, no
underscores or quotes, identifiers from an allow-list, bounded length, and (after parsing with
``evaluate=False``) every power's exponent must be a small number or a symbol, and no literal may have a 3-digit
exponent or 60+ digits, so ``9^9^9`` or ``1e999999`` cannot make the reward spin. Anything that fails the screen is simply "not equivalent".
"""

from __future__ import annotations

import re

from envs.arith import numbers_close, parse_number

MAX_CHARS = 200
_ALLOWED = re.compile(r"^[0-9a-zA-Z+\-*/^().,\s=]*$")
_BIG_LITERAL = re.compile(r"\d[eE][+-]?\d{3,}|\d{60,}")
_FUNCS = {"sqrt", "pi", "E", "e", "sin", "cos", "tan", "log", "ln", "exp", "abs", "Abs", "oo", "I"}


def _parse(text: str):
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    text = text.strip().rstrip(".")
    if "=" in text:  # "x = 5" -> the right-hand side
        text = text.split("=")[-1]
    if len(text) > MAX_CHARS or not _ALLOWED.match(text) or "__" in text:
        return None
    if _BIG_LITERAL.search(text):  # "1e999999" makes sympy spin for minutes
        return None
    idents = set(re.findall(r"[A-Za-z]+", text))
    if any(len(i) > 1 and i not in _FUNCS for i in idents):
        return None
    local = {"ln": sympy.log, "e": sympy.E}
    try:
        expr = parse_expr(
            text,
            local_dict=local,
            transformations=(*standard_transformations, implicit_multiplication, convert_xor),
            evaluate=False,
        )
    except Exception:  # sympy raises many types on garbage
        return None
    for p in expr.atoms(sympy.Pow) if isinstance(expr, sympy.Basic) else []:
        ex = p.exp
        if ex.is_Number and abs(float(ex)) > 64:
            return None
        if not (ex.is_Number or ex.is_Symbol or (ex.is_Mul and all(a.is_Number for a in ex.args))):
            return None
    return expr


def equivalent(answer: str, target: str, tol: float = 1e-6) -> bool:
    """Whether ``answer`` and ``target`` denote the same number or expression."""
    a, b = parse_number(answer), parse_number(target)
    if a is not None and b is not None:
        return numbers_close(a, b, tol)
    ea, eb = _parse(answer), _parse(target)
    if ea is None or eb is None:
        return False
    import sympy

    try:
        diff = sympy.simplify(ea - eb)
        if diff == 0:
            return True
        if not diff.free_symbols:
            return abs(complex(sympy.N(diff))) <= tol * max(1.0, abs(complex(sympy.N(eb))))
    except Exception:  # simplification/evaluation failures mean "not shown equal"
        return False
    return False
