"""What a vocabulary cannot spell. A byte-level BPE vocabulary need not hold all 256 bytes
(SmolLM2's lacks 21: six control characters, the bytes UTF-8 never uses, and 0xF1/0xF2, the lead
bytes of planes 4-11), so some characters cannot be generated at all. A constraint that requires
one after some output lets the model start down the path (the mask allows the tokens before it),
then leaves it no token: the choice would end with "error". These checks find such a character up
front, so the request gets a 400 naming it instead.

They never refuse a constraint that has a way around the character (an alternative, an optional
part): a missing byte can never be a token's first, so the mask simply never offers that way.
Where the structure is too rich to tell here (a regex or grammar with `|`, a character inside a
group), they stay silent, and a dead end still ends the choice with "error" at run time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# An escape that names one character: \xHH, \uHHHH or \u{H...} (regex and xgrammar EBNF alike).
_CODE_ESCAPE = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]{1,6})\}")
_OPTIONAL = ("?", "*", "{0", "{,")  # a quantifier that lets the item before it be absent


def vocabulary_bytes(token_bytes: Iterable[bytes]) -> frozenset[int]:
    """Every byte value that occurs in at least one token."""
    seen: set[int] = set()
    for piece in token_bytes:
        seen.update(piece)
    return frozenset(seen)


def unspellable_in_choices(choices: Sequence[str], spellable: frozenset[int]) -> str | None:
    """The character some choice needs after a prefix that no choice can go on from, or None.

    After writing a prefix p, the model may go on with any choice that starts with p: a dead end
    is a p (not itself a choice) after which every such choice needs an unspellable character.
    """
    for choice in choices:
        index = next((i for i, char in enumerate(choice) if not _spells(char, spellable)), None)
        if not index:  # spellable throughout, or never started (its first character is missing)
            continue
        prefix = choice[:index]
        if not any(
            other.startswith(prefix) and (len(other) == index or _spells(other[index], spellable))
            for other in choices
        ):
            return choice[index]
    return None


def unspellable_in_pattern(
    spec: str, spellable: frozenset[int], *, grammar: bool = False
) -> str | None:
    """The first character a regex (or, with `grammar`, an xgrammar EBNF grammar) certainly
    requires and no token spells, or None.

    Certainly required: outside every [...] class and (...) group, not made optional by `?`, `*`,
    `{0` or `{,` right after it (in a grammar: after its string literal), and the whole pattern has
    no `|`. A character is read as itself, after a backslash, or as a code escape; a grammar's
    `#` comments are skipped.
    """
    found: str | None = None
    in_class, depth, index = False, 0, 0
    while index < len(spec):
        char = spec[index]
        if in_class:
            in_class = char != "]"
            index += 2 if char == "\\" else 1
        elif grammar and char == "#":
            index = _line_end(spec, index)
        elif grammar and char == '"':
            end = _string_end(spec, index)
            if found is None and depth == 0 and not _optional(spec, end):
                found = _first_unspellable(spec, index + 1, end - 1, spellable)
            index = end
        elif char == "|":
            return None  # alternatives: which ones the mask leaves open is the grammar's business
        elif char in "[()":
            in_class, depth = char == "[", depth + {"(": 1, ")": -1}.get(char, 0)
            index += 1
        else:
            char, index = _next_char(spec, index)
            if (
                found is None
                and depth == 0
                and not (_spells(char, spellable) or _optional(spec, index))
            ):
                found = char
    return found


def describe(char: str) -> str:
    """`char` for an error message: its code point, and itself when it is printable."""
    code = f"U+{ord(char):04X}"
    return f"{code} {char!r}" if char.isprintable() else code


def _first_unspellable(spec: str, begin: int, end: int, spellable: frozenset[int]) -> str | None:
    """The first unspellable character written in spec[begin:end] (a string literal's body)."""
    index = begin
    while index < end:
        char, index = _next_char(spec, index)
        if not _spells(char, spellable):
            return char
    return None


def _next_char(spec: str, index: int) -> tuple[str, int]:
    """The character written at `index` and the index after it."""
    char = spec[index]
    if char != "\\" or index + 1 == len(spec):
        return char, index + 1
    escape = _CODE_ESCAPE.match(spec, index + 1)
    if escape is None:
        return spec[index + 1], index + 2  # \. \[ \n \d ...: one character (letters are ASCII)
    code = int(next(group for group in escape.groups() if group is not None), 16)
    return (chr(code) if code <= 0x10FFFF else "\ufffd"), escape.end()


def _string_end(spec: str, index: int) -> int:
    """The index after the string literal that opens at `index` (or the end of `spec`)."""
    index += 1
    while index < len(spec) and spec[index] != '"':
        index += 2 if spec[index] == "\\" else 1
    return min(index + 1, len(spec))


def _line_end(spec: str, index: int) -> int:
    end = spec.find("\n", index)
    return len(spec) if end < 0 else end


def _optional(spec: str, index: int) -> bool:
    return spec.startswith(_OPTIONAL, index)


def _spells(char: str, spellable: frozenset[int]) -> bool:
    return all(byte in spellable for byte in char.encode("utf-8", "surrogatepass"))
