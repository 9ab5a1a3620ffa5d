"""How much one constraint may ask of the grammar compiler.

xgrammar compiles in native code that cannot be interrupted, on a pool of two threads, and its time
grows steeply with some shapes of JSON schema. Measured with SmolLM2's 49k-token vocabulary on a
2-core AMD EPYC (Zen 4): one object's optional properties (not in "required"), 400 -> 0.2 s and
800 -> 1.0 s; five sibling objects of 256 optional properties each 0.75 s, twenty of them 41 s;
arrays nested 200 deep 0.37 s, 400 deep 2.9 s. One request could hold a pool thread for minutes
while every constrained request behind it waited. These limits refuse such constraints up front,
with a 400 that names what to shrink; within them the slowest shapes measured compiled in 3 s or
less (required properties are cheap: 3,200 in one object 0.6 s). A string's "pattern" compiles
far slower inside a schema than the same regex alone, and with its repeats rather than its length:
`^([a-z]{0,20}x){120}$` took 3.4 s (0.06 s as `guided_regex`), 300 alternatives of
`qN[a-z]{0,20}` 10 s; so a schema's patterns are limited by their size with every bounded repeat
written out (`pattern_size`; those two: 2,522 and 13,584). `COMPILE_TIMEOUT_S` is the
backstop for whatever slips through: the request fails, and the thread finishes in the background.

A subprocess that could be killed at the deadline was measured and not taken: the compiled grammar
has to come back serialized (200 optional properties: a 0.07 s compile, a 13.6 MB JSON that took
0.63 s to write and 0.23 s to read), and the child holds its own ~570 MB (xgrammar imports torch).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.configs import StructuredOutputs
from pagedserve.engine.errors import InvalidRequestError

try:  # Python's regex parser: re._parser from 3.11, sre_parse before
    from re import _constants as _regex_constants
    from re import _parser as _regex_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _regex_constants  # type: ignore[no-redef]
    import sre_parse as _regex_parser  # type: ignore[no-redef]

# A repeat `{m}` / `{m,n}` with its numbers as groups, or something to pass over: an escape, a
# [...] class, text without those; in a grammar also a string literal and a `#` comment.
_REPEAT = r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}"
_REGEX_TOKENS = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]?|" + _REPEAT + r'|[^\\\[{"#]+|.', re.S)
_GRAMMAR_TOKENS = re.compile(
    r'\\.|\[(?:\\.|[^\]\\])*\]?|"(?:\\.|[^"\\])*"?|#[^\n]*|' + _REPEAT + r'|[^\\\[{"#]+|.', re.S
)
_REPEATS = {_regex_constants.MAX_REPEAT, _regex_constants.MIN_REPEAT}
if hasattr(_regex_constants, "POSSESSIVE_REPEAT"):
    _REPEATS.add(_regex_constants.POSSESSIVE_REPEAT)

MAX_SPEC_CHARS = 128 * 1024  # a schema, regex or grammar's text; a choice list's in all
MAX_SCHEMA_DEPTH = 128  # nesting of the schema document (an object schema in an object: 2 levels)
MAX_PROPERTIES = 2048  # in the whole schema
MAX_OPTIONAL_PROPERTIES = 1024  # in the whole schema
MAX_OPTIONAL_PER_OBJECT = 256
MAX_PATTERN_SIZE = 2000  # the schema's "pattern"s, repeats written out (pattern_size): ~1-3 s
COMPILE_TIMEOUT_S = 30.0  # a request waits at most this long for its compile
# xgrammar 0.2.9 keeps counts and repeats in 32-bit ints: `a{4294967296}` compiled as `a{0}`,
# `"maxItems": 4294967297` as 1. Larger ones are refused (also in schema_support.invalid_keyword).
MAX_COUNT = 2**31 - 1
# A structural tag (structural_tag.py): its schemas, regexes and grammars each meet the limits
# above, and its schemas together too (cost grows with their sum: a tag of 4 schemas at the
# pattern limit took 7.9 s to compile, 4x one alone); at most this many parts, and this many
# `excludes` strings of this much text (1,000 excludes: 9 s, 4,000: 39 s).
MAX_TAG_PARTS = 64
MAX_EXCLUDES = 64
MAX_EXCLUDES_CHARS = 4096
# Masks are filled on the engine thread, and the whole batch waits for them. A grammar that is
# short and compiles fast can still make that cost grow with every token: xgrammar's Earley
# parser over `s ::= s s s s | s s s | s s | [a-z ] | ""` took 30 ms, then 60, 150, 310, 660,
# 1,090 ms a step by the 15th token, and an unconstrained neighbour's tokens slowed from 30 ms to
# the same. JSON schemas, regexes and choices fill in 0.4-11 ms a row. A choice whose fill takes
# longer ends with "error" after that step.
MAX_MASK_FILL_S = 0.1


def parsed_schema(constraint: StructuredOutputs) -> Any:
    """A "json" constraint's schema as Python values; None for other kinds, or text that is not
    JSON (the compiler's own error then names what is wrong)."""
    if constraint.kind != "json":
        return None
    try:
        return json.loads(constraint.spec)
    except (ValueError, RecursionError):
        return None


def check_limits(constraint: StructuredOutputs, what: str, schema: Any) -> None:
    """Raise InvalidRequestError (naming `constraint.param`) if the constraint is beyond a limit.
    `what` names the constraint in the message ("JSON schema", "regex"...); `schema` is
    `parsed_schema(constraint)`."""
    spec = constraint.spec
    size = len(spec) if isinstance(spec, str) else sum(len(choice) for choice in spec)
    found = [(size, MAX_SPEC_CHARS, "is {:,} characters long")]
    repeats: list[int] = []
    if constraint.kind in ("regex", "grammar"):
        repeats.append(largest_repeat(str(spec), grammar=constraint.kind == "grammar"))
    if schema is not None:
        depth, properties, optional, widest, patterns = _schema_shape(schema)
        repeats += map(largest_repeat, patterns)
        found += [
            (sum(map(pattern_size, patterns)), MAX_PATTERN_SIZE, "has patterns of size {:,}"),
            (depth, MAX_SCHEMA_DEPTH, "nests {} levels deep"),
            (properties, MAX_PROPERTIES, "has {:,} properties"),
            (widest, MAX_OPTIONAL_PER_OBJECT, "has an object of {:,} optional properties"),
            (optional, MAX_OPTIONAL_PROPERTIES, "has {:,} optional properties"),
        ]
    if max(repeats, default=0) > MAX_COUNT:
        raise InvalidRequestError(
            f"the {what} in {constraint.param} repeats an item more than {MAX_COUNT:,} times, "
            "the most the compiler (xgrammar) counts",
            constraint.param,
        )
    for value, limit, problem in found:
        if value > limit:
            raise InvalidRequestError(
                f"the {what} in {constraint.param} {problem.format(value)}; at most {limit:,} are "
                "compiled (xgrammar's compile time grows steeply beyond them): simplify it",
                constraint.param,
            )


def _schema_shape(schema: Any) -> tuple[int, int, int, int, list[str]]:
    """(nesting depth, properties, optional properties, most optional properties of one object,
    the "pattern" strings), walked without recursion: the document may nest as deep as json.loads
    allows."""
    depth = properties = optional = widest = 0
    patterns: list[str] = []
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, level)  # of objects and arrays, as json.loads nests them
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            declared = node.get("properties")
            if isinstance(declared, dict):
                required = node.get("required")
                listed = required if isinstance(required, list) else []
                unlisted = len(set(declared) - {name for name in listed if isinstance(name, str)})
                properties += len(declared)
                optional += unlisted
                widest = max(widest, unlisted)
            stack.extend((value, level + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, level + 1) for value in node)
    return depth, properties, optional, widest, patterns


def largest_repeat(spec: str, *, grammar: bool = False) -> int:
    """The largest count written in a repeat (`{m}`, `{m,n}`) of a regex, or with `grammar` of an
    xgrammar EBNF grammar, outside escapes, classes, string literals and comments; 0 if none."""
    tokens = _GRAMMAR_TOKENS if grammar else _REGEX_TOKENS
    numbers = (n.lstrip("0") for match in tokens.finditer(spec) for n in match.groups() if n)
    # More than ten digits is past MAX_COUNT (and int() refuses thousands of them).
    return max((int(n or "0") if len(n) <= 10 else MAX_COUNT + 1 for n in numbers), default=0)


def pattern_size(pattern: str) -> int:
    """A regex's size with every repeat written out: `x{0,20}` counts 20 x's, `(ab|c){3}` 9, an
    unbounded repeat its minimum plus one. Read with Python's regex parser (the syntax JSON
    Schema patterns share); one that it cannot read counts its length."""
    try:
        return _written_out(_regex_parser.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return len(pattern)


def _written_out(items: Any) -> int:
    total = 0
    for op, value in items:
        if op in _REPEATS:
            low, high, inner = value
            repeats = high if high != _regex_constants.MAXREPEAT else low + 1
            total += max(1, repeats) * _written_out(inner)
        elif op is _regex_constants.SUBPATTERN:
            total += _written_out(value[-1])
        elif op is _regex_constants.BRANCH:
            total += sum(_written_out(branch) for branch in value[1])
        else:
            total += 1
    return total


def check_tag_limits(
    constraint: StructuredOutputs, parts: list[StructuredOutputs], excludes: list[str]
) -> None:
    """A structural tag's limits as a whole (MAX_TAG_PARTS above); each part has been checked
    with `check_limits` on its own."""
    param = constraint.param
    counts = [
        (len(parts), MAX_TAG_PARTS, "schemas, regexes and grammars"),
        (len(excludes), MAX_EXCLUDES, "excludes strings"),
        (sum(map(len, excludes)), MAX_EXCLUDES_CHARS, "characters of excludes strings"),
    ]
    for value, limit, what in counts:
        if value > limit:
            raise InvalidRequestError(
                f"the structural tag in {param} has {value:,} {what}; at most {limit:,} are "
                "compiled (xgrammar's compile time grows with them): simplify it",
                param,
            )
    schemas = [parsed_schema(part) for part in parts if part.kind == "json"]
    if len(schemas) > 1:  # their sizes add up: checked as one schema of them all
        check_limits(constraint, "structural tag's JSON schemas, together,", {"anyOf": schemas})
