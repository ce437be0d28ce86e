"""Numeric and symbolic answer equivalence with sympy, safe on model-written strings.

sympy's parser evaluates Python, so answers are screened first: a small character set, no
underscores or quotes, identifiers from an allow-list, bounded length, and (after parsing with
``evaluate=False``) every power's exponent must be a small number or a symbol, so ``9^9^9``
cannot make the reward spin. Anything that fails the screen is simply "not equivalent".
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 200
_ALLOWED = re.compile(r"^[0-9a-zA-Z+\-*/^().,\s=]*$")
_FUNCS = {"sqrt", "pi", "E", "e", "sin", "cos", "tan", "log", "ln", "exp", "abs", "Abs", "oo", "I"}


def _plain_number(text: str) -> Fraction | None:
    t = text.strip().replace(",", "").rstrip(".")
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _parse(text: str):
    import sympy
    from sympy.parsing.sympy_parser import convert_xor, parse_expr, standard_transformations

    text = text.strip().rstrip(".")
    if "=" in text:  # "x = 5" -> the right-hand side
        text = text.split("=")[-1]
    if len(text) > MAX_CHARS or not _ALLOWED.match(text) or "__" in text:
        return None
    idents = set(re.findall(r"[A-Za-z]+", text))
    if any(len(i) > 1 and i not in _FUNCS for i in idents):
        return None
    local = {"ln": sympy.log, "e": sympy.E}
    try:
        expr = parse_expr(
            text, local_dict=local, transformations=(*standard_transformations, convert_xor), evaluate=False
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
    a, b = _plain_number(answer), _plain_number(target)
    if a is not None and b is not None:
        return abs(float(a - b)) <= tol * max(1.0, abs(float(b)))
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
