"""Safe exact arithmetic for the calculator-like tools (no ``eval``): + - * / // % ** and parentheses.

Values are exact ``Fraction``s; sizes are bounded so a model cannot make a tool spin on huge powers.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction

from envs.base import Tool, ToolError

MAX_EXPR_CHARS = 200
MAX_ABS = 10**30
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def safe_eval(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ``ToolError`` with a readable reason otherwise."""
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolError(f"cannot parse {expression!r}: {getattr(e, 'msg', e)}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        if not math.isfinite(node.value) or abs(node.value) > MAX_ABS:
            raise ToolError("number too large")
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
            raise ToolError("division by zero")
        if isinstance(node.op, ast.Pow) and (b.denominator != 1 or abs(b) > 64 or (a == 0 and b < 0)):
            raise ToolError("exponent must be an integer between -64 and 64 (and 0 has no negative power)")
        out = _BINOPS[type(node.op)](a, b)
        if abs(out) > MAX_ABS:
            raise ToolError("result too large")
        return Fraction(out)
    raise ToolError(f"unsupported syntax {type(node).__name__}: only numbers, + - * / // % ** and ( )")


def format_number(v: Fraction) -> str:
    """Integers as integers, other values with up to 6 decimals."""
    if v.denominator == 1:
        return str(v.numerator)
    return f"{float(v):.6f}".rstrip("0").rstrip(".")


_HUGE_EXPONENT = re.compile(r"[eE][+-]?\d{4,}")


def parse_number(text: str | None) -> Fraction | None:
    """A number written by a model ("1,234", "-7", "2.5", "3/4", "1e5"), or None. Exponents beyond
    999 and very long strings are refused: ``Fraction("1e999999999")`` would build a huge integer."""
    if text is None:
        return None
    t = text.strip().replace(",", "").rstrip(".")
    if len(t) > 100 or _HUGE_EXPONENT.search(t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_close(a: Fraction, b: Fraction, tol: float = 1e-6) -> bool:
    """|a - b| <= tol * max(1, |b|), exactly (no float overflow on big values)."""
    return abs(a - b) <= Fraction(tol) * max(Fraction(1), abs(b))


def numbers_match(answer: str | None, target: str, tol: float = 1e-6) -> bool:
    a, b = parse_number(answer), parse_number(target)
    return a is not None and b is not None and numbers_close(a, b, tol)


def calculator_tool() -> Tool:
    """The ``calculator`` tool shared by the envs that offer one."""
    params = {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": MAX_EXPR_CHARS}},
        "required": ["expression"],
    }
    return Tool(
        "calculator",
        "Evaluate an arithmetic expression.",
        params,
        lambda expression: format_number(safe_eval(expression)),
    )
