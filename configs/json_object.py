"""Settings given as a JSON object on the command line or in a `PAGEDSERVE_*` variable (a mapping
in the YAML file), as vLLM's `--speculative-config '{...}'` and `--hf-overrides '{...}'` are."""

from __future__ import annotations

import json


def parse_json_object(value: object, name: str) -> object:
    """A JSON string becomes a mapping; '' / 'null' / 'none' mean unset; anything else (a mapping
    from YAML, a default) passes through to the field's own validation."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("", "null", "none"):
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not valid JSON: {error.msg}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object")
    return parsed
