"""Qwen3-Coder's XML calls (vLLM's `--tool-call-parser qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

any number, after optional text (`<tool_call>` may be left out, and a last `</parameter>` or
`</function>` the reply ends without is implied, as vLLM allows). A parameter's value is raw text
(one newline either side is the layout): it is read as its type in the tool's JSON schema says,
as vLLM's and SGLang's parsers read it, so `{"days": 3}` comes back a number and a string stays a
string even when it looks like one: "null" is null; string types as written; integers and numbers
as numbers where they parse (`3.0` is 3); booleans from true/false; objects and arrays as JSON,
else Python literals. The type comes from `type` (a list: string if it allows one, else its first
other than null), else `enum` or `const` values, else `anyOf`/`oneOf` (string if one allows it);
a parameter the schema does not type, or does not declare, is text. A block that does not read as
a call stays in the content, as the model wrote it.

No pattern here scans past the next opener of its kind (`<function=`, `<parameter=`), so text
that mentions a tag does not swallow the call after it, and unclosed tags cost linear time, not
quadratic (the reply is model output: a prompt can steer it).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pagedserve.server.json_input import load_json
from pagedserve.server.tool_parsers.base import CallDelta, ParsedCall, held_back, make_call

OPENERS = ("<tool_call>", "<function=")
_CALL = re.compile(
    r"(?:<tool_call>\s*)?<function=([^<>\n]+)>((?:(?!<function=|</function>).)*)"
    r"(?:</function>|\Z)(?:\s*</tool_call>)?",
    re.DOTALL,
)
_PARAMETER = re.compile(
    r"<parameter=([^<>\n]+)>((?:(?!<parameter=|</parameter>).)*)(?:</parameter>)?", re.DOTALL
)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_CONTAINER_TYPES = ("object", "array", "dict", "list")


class Qwen3CoderParser:
    """Streams text until the first opener; from there on, each call as its `</function>` (and
    `</tool_call>`) closes, and the text around the calls at `finish`."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._types = _parameter_types(tools or [])
        self._pending = ""
        self._in_calls = False
        self._content: list[str] = []
        self._num_calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._pending += text
        if not self._in_calls:
            starts = [i for i in (self._pending.find(o) for o in OPENERS) if i >= 0]
            if not starts:
                keep = max(held_back(self._pending, opener) for opener in OPENERS)
                shown = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(shown) :]
                return shown, []
            self._in_calls = True
            start = min(starts)
            shown, self._pending = self._pending[:start], self._pending[start:]
            return shown, self._closed_calls(final=False)
        return "", self._closed_calls(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        if not self._in_calls:
            text, self._pending = self._pending, ""
            return text, []
        calls = self._closed_calls(final=True)
        return "".join(self._content).strip(), calls

    def _closed_calls(self, final: bool) -> list[CallDelta]:
        """The calls closed so far, taken out of the pending text; with `final`, all of it."""
        text = self._pending
        if not final:  # only whole functions: one cut short is read at the end
            end = text.rfind("</function>")
            if end < 0:
                return []
            end += len("</function>")
            closing = re.match(r"\s*</tool_call>", text[end:])
            if closing is None and "</tool_call>".startswith(text[end:].strip()):
                return []  # its </tool_call> may still be coming
            end += closing.end() if closing else 0
            text = text[:end]
        self._pending = self._pending[len(text) :]
        calls: list[ParsedCall] = []
        position = 0
        for match in _CALL.finditer(text):
            self._content.append(text[position : match.start()])
            position = match.end()
            call = self._call(match.group(1), match.group(2))
            if call is None:
                self._content.append(match.group(0))  # as the model wrote it
            else:
                calls.append(call)
        self._content.append(text[position:])
        deltas = [CallDelta(self._num_calls + i, c.name, c.arguments) for i, c in enumerate(calls)]
        self._num_calls += len(calls)
        return deltas

    def _call(self, name: str, body: str) -> ParsedCall | None:
        name = name.strip()
        types = self._types.get(name, {})
        arguments = {}
        for match in _PARAMETER.finditer(body):
            key = match.group(1).strip()
            arguments[key] = read_value(_unwrapped(match.group(2)), types.get(key))
        leftover = _PARAMETER.sub("", body).strip()
        if not name or leftover:  # text inside the function that is no parameter: not a call
            return None
        return make_call(name, arguments)


def _unwrapped(value: str) -> str:
    """A value without the newline the layout puts on either side of it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> parameter name -> its JSON schema type (a string, or None where untyped)."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        types[function["name"]] = {
            key: schema_type(schema)
            for key, schema in (properties if isinstance(properties, dict) else {}).items()
        }
    return types


def schema_type(schema: Any, depth: int = 0) -> str | None:
    """The type a parameter's schema gives its value (module docstring), or None."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list):
        named = [t for t in declared if isinstance(t, str) and t != "null"]
        return "string" if "string" in named else (named[0] if named else None)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    values = values or ([schema["const"]] if "const" in schema else None)
    if values:
        kinds = {_value_type(value) for value in values if value is not None}
        return "string" if "string" in kinds or len(kinds) != 1 else kinds.pop()
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alternatives, list):
        kinds = {schema_type(item, depth + 1) for item in alternatives} - {None, "null"}
        return "string" if "string" in kinds or len(kinds) != 1 else kinds.pop()
    return None


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "string"


def read_value(text: str, schema_type: Any) -> Any:
    """A parameter's text as its schema type says (module docstring)."""
    if text.strip().lower() == "null":
        return None
    kind = schema_type.lower() if isinstance(schema_type, str) else None
    if kind in _STRING_TYPES:
        return text
    if kind is not None and (kind.startswith("int") or kind in ("number", "float", "double")):
        return _number(text, integer=kind.startswith("int"))
    if kind in ("boolean", "bool"):
        word = text.strip().lower()
        return word == "true" if word in ("true", "false") else text
    if kind in _CONTAINER_TYPES:
        return _literal(text)
    return text  # untyped, or undeclared: as the model wrote it


def _number(text: str, integer: bool) -> Any:
    """An integer exactly (however long), else for a number a finite float (integral: an int),
    else the text."""
    try:
        return int(text.strip())
    except ValueError:
        if integer:
            return text
    try:
        number = float(text.strip())
    except ValueError:
        return text
    if not math.isfinite(number):
        return text
    return int(number) if number.is_integer() else number


def _literal(text: str) -> Any:
    """JSON, else a Python literal (`{'a': 1}`, `True`), else the text; a value JSON cannot carry
    (infinity, a set, bytes) is the text."""
    for read in (load_json, lambda text: ast.literal_eval(text.strip())):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return value
    return text
