"""JSON text from clients and models, read without a special case per caller."""

from __future__ import annotations

import json
from typing import Any


def load_json(text: str) -> Any:
    """`json.loads`, except that text nested past the interpreter's recursion limit (~1,000 levels)
    raises the ValueError any other malformed JSON raises, not a RecursionError (which no caller
    expects: it became a 500, or a parser crash on a model's output)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested past the interpreter's recursion limit") from None
