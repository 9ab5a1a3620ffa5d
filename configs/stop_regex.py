"""Stop patterns (SGLang's `stop_regex`): an output ends where its text first matches one.

A user's pattern runs against the output on every step, so it is compiled by RE2, which matches in
time linear in the text whatever the pattern: under Python's backtracking `re`, `(a+)+$` over a
few dozen characters of output would stall the step loop, and every request in it, for minutes.
RE2 leaves out what needs backtracking (backreferences, lookaround); a pattern that uses them is
refused with RE2's reason, as is one that matches the empty string (it would end every output
before its first character).
"""

from __future__ import annotations

import functools
import re
import re._parser as python_regex_parser

import re2

MAX_STOP_REGEX_CHARS = 1024  # a pattern's own length
# Matches that may span more than this many characters count as unbounded (_hold_chars).
MAX_BOUNDED_MATCH_CHARS = 1024

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a user's bad pattern is a 400, not a line on the server's stderr


class StopRegexError(ValueError):
    """A stop pattern RE2 cannot compile, or one that would end every output at once."""


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> re2._Regexp:
    """The compiled pattern (cached: the same patterns come back request after request).

    Raises:
        StopRegexError: RE2 refuses it (its reason), or it matches the empty string.
    """
    try:
        compiled = re2.compile(pattern, options=_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args else "invalid pattern"
        message = f"stop_regex {pattern!r} is not a valid RE2 pattern: {reason}"
        raise StopRegexError(message) from None
    if compiled.search("") is not None:
        raise StopRegexError(
            f"stop_regex {pattern!r} matches the empty string, so it would end every output at once"
        )
    return compiled


@functools.lru_cache(maxsize=1024)
def max_match_chars(pattern: str) -> int | None:
    """The most characters a match of `pattern` can span, or None if that is unbounded (a `*`,
    `+` or `{n,}`) or past MAX_BOUNDED_MATCH_CHARS. Read from Python's parse of the pattern,
    whose syntax RE2's mostly shares; a pattern Python cannot parse counts as unbounded."""
    try:
        _, widest = python_regex_parser.parse(pattern).getwidth()
    except (re.error, RecursionError, OverflowError):
        return None
    return widest if widest <= MAX_BOUNDED_MATCH_CHARS else None
