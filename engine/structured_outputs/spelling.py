"""What a vocabulary cannot spell. A byte-level BPE vocabulary need not hold all 256 bytes
(SmolLM2's lacks 21: six control characters, the bytes UTF-8 never uses, and 0xF1/0xF2, the lead
bytes of planes 4-11), so some characters cannot be generated at all. A constraint that requires
one lets the model start down the path (the mask allows the tokens before it), then leaves it no
token: the choice would end with "error". `first_unspellable` finds such a character up front, so
the request gets a 400 naming it instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# An escape that names one character: \xHH, \uHHHH or \u{H...} (regex and xgrammar EBNF alike).
_CODE_ESCAPE = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]{1,6})\}")


def vocabulary_bytes(token_bytes: Iterable[bytes]) -> frozenset[int]:
    """Every byte value that occurs in at least one token."""
    seen: set[int] = set()
    for piece in token_bytes:
        seen.update(piece)
    return frozenset(seen)


def first_unspellable(spec: str, spellable: frozenset[int], *, literal: bool = False) -> str | None:
    """The first character `spec` requires that needs a byte outside `spellable`, or None.

    `literal`: `spec` is plain text (a choice). Otherwise it is a regex or EBNF grammar: a
    character is required when written outside a [...] class, as itself, escaped by a backslash or
    as a code escape, and not made optional by a `?`, `*` or `{0` right after it. One inside a
    class is just an alternative the mask never offers, and is not reported.
    """
    if literal:
        return next((char for char in spec if not _spells(char, spellable)), None)
    in_class = False
    index = 0
    while index < len(spec):
        char, index = _next_char(spec, index)
        if char is None:  # an unescaped [ or ]
            in_class = spec[index - 1] == "["
        elif not (in_class or _spells(char, spellable) or _optional(spec, index)):
            return char
    return None


def describe(char: str) -> str:
    """`char` for an error message: its code point, and itself when it is printable."""
    code = f"U+{ord(char):04X}"
    return f"{code} {char!r}" if char.isprintable() else code


def _next_char(spec: str, index: int) -> tuple[str | None, int]:
    """The character written at `index` and the index after it; None for a class bracket."""
    char = spec[index]
    if char in "[]":
        return None, index + 1
    if char != "\\" or index + 1 == len(spec):
        return char, index + 1
    escape = _CODE_ESCAPE.match(spec, index + 1)
    if escape is None:
        return spec[index + 1], index + 2  # \. \[ \n ...: one character (letters are ASCII)
    code = int(next(group for group in escape.groups() if group is not None), 16)
    return (chr(code) if code <= 0x10FFFF else "\ufffd"), escape.end()


def _optional(spec: str, index: int) -> bool:
    return spec.startswith(("?", "*", "{0"), index)


def _spells(char: str, spellable: frozenset[int]) -> bool:
    return all(byte in spellable for byte in char.encode("utf-8", "surrogatepass"))
