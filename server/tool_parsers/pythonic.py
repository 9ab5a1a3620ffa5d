"""Pythonic calls (vLLM's `pythonic`: Llama 3.2 and 4, ToolACE): the reply is a Python list of
calls with keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`, optionally between
Llama 4's `<|python_start|>` and `<|python_end|>`. A reply that does not start like one streams
as text; one that does but is not such a list (a positional argument, an expression that is not
a literal) is returned as text at the end, whole (its calls come at the end too: all or none).

The arguments are read from Python's syntax tree, never evaluated: literals only (strings,
numbers, booleans, None, lists, dicts with string keys; JSON's true/false/null too).
"""

from __future__ import annotations

import ast
import math
import warnings
from typing import Any

from pagedserve.server.tool_parsers.base import ParsedCall, WholeReplyParser, make_call

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser(WholeReplyParser):
    TAG = START
    OPENERS = ("[",)

    def parse(self, text: str) -> list[ParsedCall]:
        return _parse_calls(text.removesuffix(END).strip())


def _parse_calls(text: str) -> list[ParsedCall]:
    """The list's calls, or [] if it is not a list of calls with literal keyword arguments."""
    try:
        with warnings.catch_warnings():  # an invalid escape ("C:\dir") warns; it stays a string
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return []
        return [_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments only")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:  # **mapping, or a repeated name
            raise ValueError("keyword arguments, each once")
        arguments[keyword.arg] = _literal(keyword.value)
    call = make_call(_dotted_name(node.func), arguments)
    if call is None:
        raise ValueError("a lone surrogate")
    return call


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("a call's name is a name")


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, bool, int, float))
    ):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("JSON has no infinities")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before a number only")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("dict keys are strings")
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
