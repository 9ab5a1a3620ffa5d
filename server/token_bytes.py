"""A token's own bytes, for the logprobs fields that describe tokens byte by byte (the chat
format's `bytes`, the legacy `text_offset`), and the name logprobs give a token.

Decoding one token alone turns a piece of a multi-byte character (half an emoji) into U+FFFD, whose
three bytes say nothing about the token: OpenAI's `bytes` exists so that a client can join pieces
like that back into the character. So a token that decodes to U+FFFD is read from the vocabulary
instead: a byte-level BPE piece (GPT-2's printable spelling of each byte: SmolLM2, Llama 3, Qwen)
or a SentencePiece byte-fallback piece (`<0xF0>`). Other tokens are their decoded text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character that spells each byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes token `token_id` stands for (its decoded text where it decodes cleanly)."""
    text = tokenizer.decode([token_id])
    if REPLACEMENT not in text or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode()
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback is not None:
        return bytes([int(fallback.group(1), 16)])
    byte_of_char = _byte_of_char()
    if piece and all(char in byte_of_char for char in piece):
        return bytes(byte_of_char[char] for char in piece)
    return text.encode()


def token_name(tokenizer: Any, token_id: int, as_token_id: bool = False) -> str:
    """A token as the logprobs fields name it: its decoded text, or with vLLM's
    `return_tokens_as_token_ids` the string `token_id:<id>`, which tells apart tokens whose text
    alone does not (two that decode alike, half a character)."""
    return f"token_id:{token_id}" if as_token_id else tokenizer.decode([token_id])
