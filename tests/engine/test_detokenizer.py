"""IncrementalDetokenizer with the default model's byte-level BPE tokenizer: deltas add up to the
full decode, never split a UTF-8 character (emoji, CJK), and stop strings are cut without ever
leaking a prefix of a match mid-stream."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.configs.stop_regex import MAX_MATCH_CHARS
from pagedserve.engine.detokenizer import IncrementalDetokenizer

MULTIBYTE_TEXT = "Hi 👋🏽 世界 🚀 café — ÅÄÖ 🇯🇵 naïve 한국어 text 🧑‍🚀!"
PROMPT = "Say something:"


def _stream(
    tokenizer,
    text: str,
    stop: tuple[str, ...] = (),
    include_stop: bool = False,
    prompt: str = PROMPT,
):
    """Feed `text`'s tokens one at a time; return (deltas, hit, flushed tail)."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), stop, include_stop)
    deltas = []
    for token_id in tokenizer.encode(text):
        delta, hit = detokenizer.add([token_id])
        deltas.append(delta)
        if hit:
            return deltas, True, ""
    tail, hit = detokenizer.flush()
    return deltas, hit, tail


def test_multibyte_tokens_really_split_characters(default_tokenizer):
    pieces = [default_tokenizer.decode([t]) for t in default_tokenizer.encode(MULTIBYTE_TEXT)]
    assert any("\ufffd" in piece for piece in pieces), (
        "the fixture text must split UTF-8 characters"
    )


def test_incremental_text_equals_full_decode_and_never_splits_a_character(default_tokenizer):
    deltas, hit, tail = _stream(default_tokenizer, MULTIBYTE_TEXT)
    assert not hit
    assert "".join(deltas) + tail == default_tokenizer.decode(
        default_tokenizer.encode(MULTIBYTE_TEXT)
    )
    assert all("\ufffd" not in delta for delta in deltas)


def test_incremental_text_keeps_the_leading_space_of_the_first_output_token(default_tokenizer):
    deltas, _, tail = _stream(default_tokenizer, " hello world", prompt="Greeting:")
    assert "".join(deltas) + tail == " hello world"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.text(alphabet=st.sampled_from(list("ab ,.\n世界東京한국🚀👋🏽éß—")), min_size=1, max_size=40)
)
def test_any_text_streams_to_its_full_decode_without_broken_characters(default_tokenizer, text):
    deltas, _, tail = _stream(default_tokenizer, text)
    assert "".join(deltas) + tail == default_tokenizer.decode(default_tokenizer.encode(text))
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected"),
    [
        ("The answer is 42. END of story", ("END",), False, "The answer is 42. "),
        ("The answer is 42. END of story", ("END",), True, "The answer is 42. END"),
        ("one ## two ### three", ("###",), False, "one ## two "),
        ("first line\n\nsecond line", ("\n\n", "line"), False, "first "),
        ("世界 🚀 stop here 東京", ("🚀",), True, "世界 🚀"),
        ("alphabetagamma", ("beta", "gamma"), False, "alpha"),
    ],
)
def test_stop_string_is_cut_and_no_prefix_of_it_leaks_mid_stream(
    default_tokenizer, text, stop, include, expected
):
    deltas, hit, _ = _stream(default_tokenizer, text, stop, include)
    assert hit
    assert "".join(deltas) == expected
    emitted = ""
    for delta in deltas:  # every intermediate stream is a prefix of the final, cut text
        emitted += delta
        assert expected.startswith(emitted), f"leaked {emitted!r} beyond {expected!r}"


def test_partial_stop_string_is_released_once_it_cannot_match(default_tokenizer):
    deltas, hit, tail = _stream(default_tokenizer, "a EN then E and EN done", ("END",))
    assert not hit
    assert "".join(deltas) + tail == "a EN then E and EN done"


class PieceTokenizer:
    """Token i decodes to PIECES[i] (bytes), so a token can end inside a UTF-8 character."""

    PIECES = {1: b"x", 2: b"E", 3: b"N", 4: b"D\xc3", 5: b"\xa9", 6: b"!", 7: b"D"}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.PIECES[t] for t in token_ids).decode("utf-8", errors="replace")


def test_a_stop_string_completed_by_a_token_ending_mid_character_is_cut_at_the_end():
    # "D\xc3" completes "END" but its text is held back as a partial character; the request then
    # ends before the character's second byte: flush() must still cut at the stop string.
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop=("END",))
    deltas = [detokenizer.add([token])[0] for token in (1, 2, 3, 4)]
    tail, hit = detokenizer.flush()
    assert "".join(deltas) + tail == "x" and hit


def test_flush_without_a_stop_string_emits_the_partial_character():
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop=("END",))
    deltas = [detokenizer.add([token])[0] for token in (1, 2, 4)]
    tail, hit = detokenizer.flush()
    assert "".join(deltas) + tail == "xED\ufffd" and not hit


def _feed(detokenizer: IncrementalDetokenizer, tokens: list[int]) -> tuple[str, bool]:
    """Feed tokens one at a time up to a stop string; returns (all text, whether one hit)."""
    text = ""
    for token in tokens:
        delta, hit = detokenizer.add([token])
        text += delta
        if hit:
            return text, True
    tail, hit = detokenizer.flush()
    return text + tail, hit


def test_a_stop_string_counts_only_after_min_tokens():
    # "END" appears with the 5th token ("D\xc3" then "\xa9": "xENDé"): with min_tokens 5 it
    # does not count (vLLM: only from the token after the first min_tokens); the later "END" does.
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 7, 6]
    assert _feed(IncrementalDetokenizer(PieceTokenizer(), [6], ("END",)), tokens) == ("x", True)
    early = IncrementalDetokenizer(PieceTokenizer(), [6], ("END",), min_tokens=4)
    assert _feed(early, tokens) == ("x", True)
    late = IncrementalDetokenizer(PieceTokenizer(), [6], ("END",), min_tokens=5)
    assert _feed(late, tokens) == ("xENDéx", True)
    never = IncrementalDetokenizer(PieceTokenizer(), [6], ("END",), min_tokens=10)
    assert _feed(never, tokens) == ("xENDéxEND!", False)


@pytest.mark.parametrize(("include_stop", "text"), [(False, "xE"), (True, "xE!")])
def test_the_token_that_ends_the_output_has_no_text_unless_asked(include_stop, text):
    detokenizer = IncrementalDetokenizer(
        PieceTokenizer(),
        [6],
        include_stop_str_in_output=include_stop,
        stop_token_ids=frozenset({6}),
    )
    assert _feed(detokenizer, [1, 2, 6]) == (text, False)


def test_a_stop_token_id_mid_output_is_text_like_any_other():
    # Only a run's last token ends the output; the same id earlier (a speculative run is fed
    # one token at a time, so this cannot happen there) keeps its text.
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_token_ids=frozenset({6}))
    assert detokenizer.add([6, 1])[0] + detokenizer.flush()[0] == "!x"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_stay_in_the_text_when_not_skipped(default_tokenizer, skip):
    (end,) = default_tokenizer.encode("<|im_end|>")  # one special token
    token_ids = [*default_tokenizer.encode("Hi"), end, *default_tokenizer.encode(" there")]
    detokenizer = IncrementalDetokenizer(
        default_tokenizer, default_tokenizer.encode(PROMPT), skip_special_tokens=skip
    )
    text = "".join(detokenizer.add([token_id])[0] for token_id in token_ids)
    text += detokenizer.flush()[0]
    assert text == ("Hi there" if skip else "Hi<|im_end|> there")


class CharTokenizer:
    """Token i is the character chr(i)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


def test_a_short_stop_string_held_back_before_min_tokens_does_not_end_the_output_later():
    # "x" comes within the first min_tokens tokens and stays held (the longer stop string
    # holds 7 characters back); only a stop string that ends in new text counts afterwards.
    detokenizer = IncrementalDetokenizer(
        CharTokenizer(), [ord(">")], ("x", "longstop"), min_tokens=2
    )
    assert _feed(detokenizer, [ord(c) for c in "axbcx"]) == ("axbc", True)


# ---- stop patterns (SGLang's stop_regex) ----------------------------------------------------------


def _stream_patterns(tokenizer, text: str, patterns: tuple[str, ...], include: bool = False):
    """Feed `text`'s tokens one at a time; return (deltas, hit, flushed tail, matched pattern)."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, tokenizer.encode(PROMPT), (), include, stop_regex=patterns
    )
    deltas = []
    for token_id in tokenizer.encode(text):
        delta, hit = detokenizer.add([token_id])
        deltas.append(delta)
        if hit:
            return deltas, True, "", detokenizer.matched_stop
    tail, hit = detokenizer.flush()
    return deltas, hit, tail, detokenizer.matched_stop


@pytest.mark.parametrize(
    ("text", "patterns", "include", "expected"),
    [
        ("Order 66 was given on day 1234.", (r"\d{4}",), False, "Order 66 was given on day "),
        ("Order 66 was given on day 1234.", (r"\d{4}",), True, "Order 66 was given on day 1234"),
        ("first line\n\nsecond line", (r"\n\s*\n", r"sec"), False, "first line"),
        ("the answer is: B) because", (r"[A-D]\)",), True, "the answer is: B)"),
        ("Ünïcödé 世界 END 東京", (r"(?i)end",), False, "Ünïcödé 世界 "),
    ],
)
def test_a_bounded_pattern_is_cut_at_its_first_match_and_no_part_of_it_leaks(
    default_tokenizer, text, patterns, include, expected
):
    deltas, hit, _, matched = _stream_patterns(default_tokenizer, text, patterns, include)
    assert hit and matched in patterns
    assert "".join(deltas) == expected
    emitted = ""
    for delta in deltas:  # held back while a match could still be starting
        emitted += delta
        assert expected.startswith(emitted), f"leaked {emitted!r} beyond {expected!r}"


def test_an_unbounded_pattern_ends_the_output_at_once_where_it_first_matches(default_tokenizer):
    # `Total: \d+` matches as soon as one digit is out. No length bounds its match, so nothing
    # is held back for it: "Total: " has streamed by then, and the output ends where it stands.
    deltas, hit, _, matched = _stream_patterns(
        default_tokenizer, "Items: 3 apples. Total: 42 coins", (r"Total: \d+",)
    )
    assert hit and matched == r"Total: \d+"
    assert "".join(deltas) == "Items: 3 apples. Total: "
    # Bounded to a few characters, the same stop is held back and cut at the match's start.
    deltas, hit, _, _ = _stream_patterns(
        default_tokenizer, "Items: 3 apples. Total: 42 coins", (r"Total: \d{1,3}",)
    )
    assert hit and "".join(deltas) == "Items: 3 apples. "


def test_text_that_never_matches_streams_whole(default_tokenizer):
    deltas, hit, tail, matched = _stream_patterns(
        default_tokenizer, "no digits here, only words", (r"\d", r"ZZ+")
    )
    assert not hit and matched is None
    assert "".join(deltas) + tail == "no digits here, only words"


def test_a_pattern_counts_only_from_the_first_character_after_min_tokens():
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 7, 6]  # "xENDéxEND!"
    early = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=("EN{1,3}D",))
    assert _feed(early, tokens) == ("x", True)
    late = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=("EN{1,3}D",), min_tokens=5)
    assert _feed(late, tokens) == ("xENDéx", True)


def test_a_backtracking_nightmare_for_pythons_re_matches_in_linear_time():
    # Under `re`, `(x+)+!` against 40 x's and no "!" backtracks ~2**40 times per search (hours);
    # RE2 answers each search in time linear in the text.
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=("(x+)+!",))
    text, hit = _feed(detokenizer, [1] * 400 + [2])
    assert text == "x" * 400 + "E" and not hit
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=("(x+)+!",))
    assert _feed(detokenizer, [2] + [1] * 400 + [6]) == ("E" + "x" * 400, True)  # unbounded


def test_a_trailing_assertion_holds_back_one_more_character():
    # `ED\B` matches "ED" only once the character after it is out (no word boundary there); the
    # "E" and "D" stay held back until then, so nothing of the match streams.
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=(r"ED\B",))
    deltas = [detokenizer.add([token])[0] for token in (1, 2, 7)]
    assert deltas == ["", "", "x"]
    assert detokenizer.add([1]) == ("", True)  # "xEDx": cut at the match
    assert detokenizer.text == "x"


def test_an_unbounded_match_is_found_after_a_long_output_within_its_reach():
    # Each step searches only the last MAX_MATCH_CHARS characters before the new text, so a long
    # output costs no more per step; a match that fits there is found however late it comes.
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=(r"EN+D!",))
    text, hit = _feed(detokenizer, [1] * 5000 + [2, 3, 3, 7, 6])
    assert hit and text == "x" * 5000 + "ENND"  # unbounded: "ENND" streamed before "!" came


def test_a_match_longer_than_the_reach_is_not_looked_for():
    long_gap = [2] + [1] * (MAX_MATCH_CHARS + 10) + [7]  # "E", then x's, then "D"
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=("Ex*D",))
    assert _feed(detokenizer, long_gap)[1] is False
    short_gap = [2] + [1] * 100 + [7]
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [6], stop_regex=("Ex*D",))
    assert _feed(detokenizer, short_gap)[1] is True
