"""JSON Schema keywords xgrammar compiles without enforcing.

xgrammar 0.2 builds its grammar from the keywords it knows and passes over the rest, so a schema
using one of these would constrain less than it says: the output could break it (checked with
xgrammar's matcher in tests/engine/test_grammar_masks.py, which fails once a new xgrammar starts
enforcing one). Such a schema is refused with a 400 naming the keyword, rather than answered with
JSON that does not match it. `oneOf` is kept: it is compiled as `anyOf`, which differs only for a
value that matches several branches.
"""

from __future__ import annotations

from typing import Any

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
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(schema: Any) -> str | None:
    """What some subschema of `schema` uses that would not be enforced ("'not'"), or None. Walks
    subschemas only (a property may be named "not"), without recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
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
        stack.extend(node.get(key) for key in _SUBSCHEMA)
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return None
