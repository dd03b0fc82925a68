"""The built-in calculator tool: arithmetic parsed with ``ast``, never evaluated as Python.

Only numbers, ``+ - * / // % **``, unary signs and parentheses are accepted; anything else
(names, calls, attributes, strings) is refused with a message. Exponents and intermediate
magnitudes are bounded so that ``9**9**9`` is an error, not a frozen process.
"""

from __future__ import annotations

import ast
import operator

__all__ = ["calculator"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_MAGNITUDE = 10**100
_MAX_CHARS = 500


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > _MAX_MAGNITUDE:
            raise ValueError("the result is out of range")
        return result
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    result = _value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)
