"""JSON Schema keywords xgrammar compiles without enforcing.

xgrammar 0.2 builds its grammar from the keywords it knows and passes over the rest, so a schema
using one of these would constrain less than it says: the output could break it (checked with
xgrammar's matcher in tests/engine/test_grammar_masks.py, which fails once a new xgrammar starts
enforcing one). Such a schema is refused with a 400 naming the keyword, rather than answered with
JSON that does not match it. `oneOf` is kept: it is compiled as `anyOf`, which differs only for a
value that matches several branches.

It also reads some invalid schemas as valid ones (xgrammar 0.2.9): a negative `maxLength` or
`minItems` as no bound, a count past 2^31 - 1 wrapped around (`maxItems: 4294967297` as 1), an
empty `anyOf` as "nothing but the end" and an empty `allOf` as "anything". JSON Schema requires
those counts to be non-negative integers and those lists to be non-empty, so such a schema is
refused with a 400 naming the keyword (`invalid_keyword`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagedserve.engine.structured_outputs.limits import MAX_COUNT

_IGNORED = {  # keyword -> how the client reads it
    "not": "'not'",
    "if": "'if' / 'then' / 'else'",
    "contains": "'contains'",
    "dependentRequired": "'dependentRequired'",
}
# Keywords whose value is one subschema, or a list / a map of them.
_SUBSCHEMA = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NON_EMPTY_LISTS = ("allOf", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(schema: Any) -> str | None:
    """What some subschema of `schema` uses that would not be enforced ("'not'"), or None."""
    for node in _subschemas(schema):
        for keyword, reason in _IGNORED.items():
            if keyword in node:
                return reason
        if node.get("uniqueItems") is True:
            return "'uniqueItems'"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return "'allOf' of more than one schema"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):  # nothing is fetched
            return f"a '$ref' outside the schema ({ref[:80]!r})"
    return None


def invalid_keyword(schema: Any) -> str | None:
    """What some subschema of `schema` gets wrong that xgrammar would read as something else
    ("'maxLength' is -1; ..."), or None. Counts of another type are left to xgrammar, which
    names them itself."""
    for node in _subschemas(schema):
        for keyword in _COUNTS:
            count = node.get(keyword)
            number = isinstance(count, (int, float)) and not isinstance(count, bool)
            if number and not 0 <= count <= MAX_COUNT:
                return f"'{keyword}' is {count}; it must be an integer from 0 to {MAX_COUNT:,}"
        for keyword in _NON_EMPTY_LISTS:
            if node.get(keyword) == []:
                return f"'{keyword}' is empty; it must list at least one schema"
    return None


def _subschemas(schema: Any) -> Iterator[dict]:
    """`schema` and every subschema in it that is an object, walked without recursion; only
    subschemas (a property may be named "not"; its schema is still walked)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        stack.extend(node.get(key) for key in _SUBSCHEMA)
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
