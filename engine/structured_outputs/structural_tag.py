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

`embedded_constraints` lists the schemas, regexes and grammars inside a tag as constraints of their
own, so each is held to the same limits and schema checks as if a request had sent it alone.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar

from pagedserve.configs import StructuredOutputs

# Format nodes whose content is one of our constraint kinds: node type -> (its field, our kind).
_CONTENT_NODES = {
    "json_schema": ("json_schema", "json"),
    "regex": ("pattern", "regex"),
    "grammar": ("grammar", "grammar"),
}


def is_legacy(tag: dict[str, Any]) -> bool:
    return "structures" in tag


def embedded_constraints(constraint: StructuredOutputs) -> list[StructuredOutputs]:
    """The schemas, regexes and grammars inside a structural tag, each as its own constraint
    (named by the tag's request field); [] for any other constraint, or for a tag that is not
    JSON (xgrammar's own error then names what is wrong)."""
    if constraint.kind != "structural_tag":
        return []
    try:
        tag = json.loads(constraint.spec)  # type: ignore[arg-type]
    except (ValueError, RecursionError):
        return []
    found: list[tuple[str, Any]] = []
    if isinstance(tag, dict) and is_legacy(tag):
        structures = tag.get("structures")
        for item in structures if isinstance(structures, list) else []:
            if isinstance(item, dict) and "schema" in item:
                found.append(("json", item["schema"]))
    else:
        _walk(tag, found)
    return [
        StructuredOutputs(kind, _text(value), constraint.param)  # type: ignore[arg-type]
        for kind, value in found
        if isinstance(value, (str, dict, bool)) and value not in ("", {})
    ]


def _text(value: str | dict[str, Any] | bool) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _walk(node: Any, found: list[tuple[str, Any]]) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item, found)
        return
    if not isinstance(node, dict):
        return
    content = _CONTENT_NODES.get(node.get("type"))  # type: ignore[arg-type]
    if content is not None and content[0] in node:
        found.append((content[1], node[content[0]]))
        return
    for value in node.values():
        _walk(value, found)


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
            raise ValueError(
                f"structures need begin, schema and end, and triggers: {error}"
            ) from None
        return compiler.compile_structural_tag(items, triggers)
    return compiler.compile_structural_tag(spec)
