"""Tokens byte by byte (server/token_bytes.py) with the default model's byte-level BPE tokenizer:
the chat format's `bytes` rebuild split characters, and the legacy `text_offset` stays in order
and inside the text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.configs.engine import DEFAULT_MODEL
from pagedserve.engine.model_loader import resolve_model_path
from pagedserve.engine.outputs import RequestDelta, TokenLogprob
from pagedserve.server.logprobs import ChoiceText
from pagedserve.server.token_bytes import token_bytes

SPLIT_TEXT = "I love 😀😀 and 你好 so 🌟"


@pytest.fixture(scope="module")
def tokenizer():
    path, _ = resolve_model_path(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_token_bytes_rebuild_characters_split_across_tokens(tokenizer):
    token_ids = tokenizer.encode(SPLIT_TEXT)
    pieces = [token_bytes(tokenizer, token_id) for token_id in token_ids]
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in token_ids)
    assert b"".join(pieces) == SPLIT_TEXT.encode()
    for token_id, piece in zip(token_ids, pieces, strict=True):
        text = tokenizer.decode([token_id])
        assert piece == text.encode() or "\ufffd" in text


class ByteFallbackTokenizer:
    """SentencePiece's spelling of a byte that is not a whole character."""

    def decode(self, token_ids: list[int]) -> str:
        return "\ufffd"

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return "<0xF0>"


def test_a_sentencepiece_byte_fallback_token_is_its_byte():
    assert token_bytes(ByteFallbackTokenizer(), 7) == b"\xf0"


def _logprob(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, ((token_id, -0.5),), rank=1)


def test_text_offsets_stay_in_order_and_inside_the_echoed_text(tokenizer):
    prompt_ids = tokenizer.encode(SPLIT_TEXT)
    generated_ids = tokenizer.encode(" 😀 ok 你")
    choice = ChoiceText(tokenizer, SPLIT_TEXT, prompt_ids, num_echo_top=1)
    prompt_entries = (None, *(_logprob(token_id) for token_id in prompt_ids[1:]))
    first = RequestDelta(
        "r",
        0,
        tuple(generated_ids[:2]),
        "",
        tuple(map(_logprob, generated_ids[:2])),
        0,
        2,
        prompt_logprobs=prompt_entries,
    )
    rest = RequestDelta(
        "r", 0, tuple(generated_ids[2:]), "", tuple(map(_logprob, generated_ids[2:])), 0, 9
    )
    _, head = choice.take(first)
    _, tail = choice.take(rest)
    offsets = head.text_offset + tail.text_offset
    text = SPLIT_TEXT + " 😀 ok 你"
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert offsets[len(prompt_ids)] == len(SPLIT_TEXT)  # the first generated token starts there

    # each token at the first character it has bytes of: the whole characters before it
    def starts(token_ids: list[int], base: int) -> list[int]:
        pieces = [token_bytes(tokenizer, token_id) for token_id in token_ids]
        return [
            base + len(b"".join(pieces[:i]).decode("utf-8", "ignore")) for i in range(len(pieces))
        ]

    assert offsets == starts(prompt_ids, 0) + starts(generated_ids, len(SPLIT_TEXT))
