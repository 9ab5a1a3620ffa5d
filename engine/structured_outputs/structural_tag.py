"""Structural tags (vLLM's `response_format` type `structural_tag`, `structured_outputs.
structural_tag`; SGLang's `structural_tag`): free text, except that once the output writes a
trigger (`<function=`) it must complete one of the tags that start with it, whose content is
constrained (a JSON schema, a regex, a grammar...) up to the tag's end (`</function>`). This is how
a model's own tool-call syntax gets schema-checked arguments while it stays free to answer in text.

Two shapes, both as xgrammar compiles them:
- the original one, `{"structures": [{"begin", "schema", "end"}...], "triggers": [...]}`
  (xgrammar's `StructuralTagItem`s);
- xgrammar's format tree, `{"type": "structural_tag", "format": {...}}`, whose nodes are typed
  (`triggered_tags`, `tag`, `sequence`, `json_schema`, `regex`, `grammar`, `const_string`...).

`tag_parts` takes a tag apart so that it is no way around what a constraint sent alone is held to
(engine/structured_outputs/limits.py, spelling.py): the schemas, regexes and grammars inside it,
each checked as its own constraint and all of them together against the whole-schema limits; the
text it makes the output write (begins, ends, constant strings), which a token must be able to
spell; and its `excludes` strings, whose number and length xgrammar's compile time grows with
(1,000 of them: 9 s). A node type xgrammar 0.2.9 does not define is refused rather than walked
past, so a new kind of node cannot hide a schema from the checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import xgrammar

from pagedserve.configs import StructuredOutputs
from pagedserve.engine.errors import InvalidRequestError

# Node type -> its field holding one of our constraint kinds, and that kind.
_CONTENT_NODES = {
    "json_schema": ("json_schema", "json"),
    "qwen_xml_parameter": ("json_schema", "json"),
    "regex": ("pattern", "regex"),
    "grammar": ("grammar", "grammar"),
}
# Node type -> its fields holding text the output must write (a string, or a list of strings).
_LITERAL_FIELDS = {
    "const_string": ("value",),
    "tag": ("begin", "end"),
    "triggered_tags": ("triggers",),
    "tags_with_separator": ("separator",),
}
_OTHER_NODES = {  # xgrammar 0.2.9's other node types; "structural_tag" is the root
    "structural_tag",
    "any_text",
    "token",
    "exclude_token",
    "any_tokens",
    "sequence",
    "or",
    "token_triggered_tags",
    "optional",
    "plus",
    "star",
    "repeat",
    "dispatch",
    "token_dispatch",
}
NODE_TYPES = frozenset(_CONTENT_NODES) | frozenset(_LITERAL_FIELDS) | _OTHER_NODES


@dataclass
class TagParts:
    """What a structural tag holds (module docstring)."""

    constraints: list[StructuredOutputs] = field(default_factory=list)
    literals: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=list)


def is_legacy(tag: dict[str, Any]) -> bool:
    return "structures" in tag


def tag_parts(constraint: StructuredOutputs) -> TagParts:
    """A structural tag's parts, its constraints named by the tag's request field; empty for any
    other constraint, or for a tag that is not JSON (xgrammar's own error then names what is
    wrong). Raises InvalidRequestError for a node type xgrammar does not define."""
    parts = TagParts()
    if constraint.kind != "structural_tag":
        return parts
    try:
        tag = json.loads(constraint.spec)  # type: ignore[arg-type]
    except (ValueError, RecursionError):
        return parts
    found: list[tuple[str, Any]] = []
    if isinstance(tag, dict) and is_legacy(tag):
        _legacy_parts(tag, found, parts)
    else:
        _walk(tag, found, parts, constraint.param)
    parts.constraints = [
        StructuredOutputs(kind, _text(value), constraint.param)  # type: ignore[arg-type]
        for kind, value in found
        if isinstance(value, (str, dict, bool)) and value not in ("", {})
    ]
    return parts


def _legacy_parts(tag: dict[str, Any], found: list[tuple[str, Any]], parts: TagParts) -> None:
    structures = tag.get("structures")
    for item in structures if isinstance(structures, list) else []:
        if isinstance(item, dict):
            if "schema" in item:
                found.append(("json", item["schema"]))
            _add_strings(parts.literals, item.get("begin"), item.get("end"))
    _add_strings(parts.literals, tag.get("triggers"))


def _walk(node: Any, found: list[tuple[str, Any]], parts: TagParts, param: str) -> None:
    stack = [node]
    while stack:  # iterative: xgrammar refuses deep tags itself, after this walk
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind is not None and kind not in NODE_TYPES:
            raise InvalidRequestError(
                f"the structural tag in {param} has a node of type {kind!r}, which is not "
                "supported",
                param,
            )
        _add_strings(parts.excludes, node.get("excludes"))
        _add_strings(parts.literals, *(node.get(name) for name in _LITERAL_FIELDS.get(kind, ())))
        if kind == "dispatch":  # rules: [trigger string, format] pairs
            rules = node.get("rules")
            _add_strings(parts.literals, *(r[0] for r in rules or [] if isinstance(r, list) and r))
        content = _CONTENT_NODES.get(kind)  # type: ignore[arg-type]
        if content is not None and content[0] in node:
            found.append((content[1], node[content[0]]))
            continue  # a schema is not walked as tag nodes
        stack.extend(value for value in node.values() if isinstance(value, (dict, list)))


def _add_strings(into: list[str], *values: Any) -> None:
    for value in values:
        if isinstance(value, str):
            into.append(value)
        elif isinstance(value, list):
            into.extend(item for item in value if isinstance(item, str))


def _text(value: str | dict[str, Any] | bool) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def compile_structural_tag(
    compiler: xgrammar.GrammarCompiler, spec: str
) -> xgrammar.CompiledGrammar:
    """Compile either shape (module docstring); a malformed one raises ValueError."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and is_legacy(tag):
        try:
            items = [
                xgrammar.StructuralTagItem(
                    begin=item["begin"], schema=_text(item["schema"]), end=item["end"]
                )
                for item in tag["structures"]
            ]
            triggers = list(tag["triggers"])
        except (KeyError, TypeError) as error:
            message = f"structures need begin, schema and end, and triggers: {error}"
            raise ValueError(message) from None
        return compiler.compile_structural_tag(items, triggers)
    return compiler.compile_structural_tag(spec)
