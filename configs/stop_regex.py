"""Stop patterns (SGLang's `stop_regex`): an output ends where its text first matches one.

A user's pattern runs against the output on every step, so it is compiled by RE2, which matches in
time linear in the text whatever the pattern: under Python's backtracking `re`, `(a+)+$` over a
few dozen characters of output would stall the step loop, and every request in it, for minutes.
Each step searches only the text a new match could occupy (`StopPattern.reach`), so a request's cost
per step stays bounded however long its output grows. RE2 leaves out what needs backtracking
(backreferences, lookaround); a pattern that uses them is refused with RE2's reason, as is one
that can match the empty string (it would end an output before any text of its own). RE2's `\\d`,
`\\w`, `\\s` and `\\b` are ASCII, unlike Python's.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass

import re2

try:  # Python's regex parser: re._parser from 3.11, sre_parse before
    from re import _parser as _python_regex_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _python_regex_parser  # type: ignore[no-redef]

MAX_STOP_REGEX_CHARS = 1024  # a pattern's own length
# How far back from a step's new text a match is looked for: the whole of a match of at most this
# many characters; an unbounded pattern (`\d+`, `.*`) is searched this far back only.
MAX_MATCH_CHARS = 1024

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a user's bad pattern is a 400, not a line on the server's stderr
# RE2's DFA cache per pattern (default 8 MiB): 16 patterns on each of 64 running requests stay
# within ~1 GiB even if every one is built to exhaust it; the searched windows stay short.
_OPTIONS.max_mem = 1 << 20
# Texts a pattern must not match with zero characters (RE2 has no minimum-width query; Python's
# parser answers it where it can read the pattern).
_EMPTY_MATCH_PROBES = ("", "a", "a b", " ", "\n", "0", ".")


class StopRegexError(ValueError):
    """A stop pattern RE2 cannot compile, or one that can match the empty string."""


def compile_stop_regex(pattern: str) -> re2._Regexp:
    """The compiled pattern (`stop_pattern` caches it).

    Raises:
        StopRegexError: RE2 refuses it (its reason), or it can match the empty string.
    """
    try:
        compiled = re2.compile(pattern, options=_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args else "invalid pattern"
        message = f"stop_regex {pattern!r} is not a valid RE2 pattern: {reason}"
        raise StopRegexError(message) from None
    widths = _python_widths(pattern)
    empty = any(_matches_empty(compiled, probe) for probe in _EMPTY_MATCH_PROBES)
    if empty or (widths is not None and widths[0] == 0):
        raise StopRegexError(
            f"stop_regex {pattern!r} can match the empty string, so it would end an output "
            "before any text of its own"
        )
    return compiled


def _matches_empty(compiled: re2._Regexp, text: str) -> bool:
    return any(match.start() == match.end() for match in compiled.finditer(text))


def _python_widths(pattern: str) -> tuple[int, int] | None:
    """(fewest, most) characters a match spans as Python's parser reads the pattern (RE2's syntax
    is mostly the same), or None where it cannot read it."""
    try:
        with warnings.catch_warnings():  # e.g. a FutureWarning for RE2's [[:digit:]]
            warnings.simplefilter("ignore")
            return _python_regex_parser.parse(pattern).getwidth()
    except (re.error, RecursionError, OverflowError):
        return None


def max_match_chars(pattern: str) -> int | None:
    """The most characters a match of `pattern` can span, or None if that is unbounded (a `*`,
    `+` or `{n,}`), past MAX_MATCH_CHARS, or unknown (a pattern Python's parser cannot read)."""
    widths = _python_widths(pattern)
    return widths[1] if widths is not None and widths[1] <= MAX_MATCH_CHARS else None


@dataclass(frozen=True, slots=True)
class StopPattern:
    """A stop pattern as the detokenizer uses it (`stop_pattern`)."""

    text: str  # as the request gave it: the stop reason
    compiled: re2._Regexp
    # How many characters before a step's new text a new match can start: a bounded match's
    # width and one more (an assertion such as `\\b` that the next character completes), or
    # MAX_MATCH_CHARS for an unbounded pattern.
    reach: int
    # Characters held back from a stream because they may begin a match: a bounded match's
    # width (as `reach`, less the one after it); none for an unbounded pattern.
    hold: int


@functools.lru_cache(maxsize=128)
def stop_pattern(pattern: str) -> StopPattern:
    """`pattern` compiled and sized (cached: the same patterns come back request after request).

    Raises:
        StopRegexError: as `compile_stop_regex`.
    """
    widest = max_match_chars(pattern)
    reach = MAX_MATCH_CHARS if widest is None else widest + 1
    return StopPattern(pattern, compile_stop_regex(pattern), reach, widest or 0)
