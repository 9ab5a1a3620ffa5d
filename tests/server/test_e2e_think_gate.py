"""End to end: a constrained chat reply on a server with `--reasoning-parser qwen3`, through the
official `openai` client, on a model whose tokenizer has <think> and </think> as one token each
(a tiny random-weight Llama with the default model's tokenizer plus the two tags). logit_bias
steers the tags: the engine's grammar must wait out the think block and hold after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pagedserve.engine.model_loader import DEFAULT_MODEL, resolve_model_path
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> tuple[Path, int, int]:
    """A model folder whose tokenizer has the think tags as single tokens; (path, open, close)."""
    folder = tmp_path_factory.mktemp("thinking-model")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL)[0])
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return folder, open_id, close_id


@pytest.fixture(scope="module")
def client(thinking_model) -> Iterator[openai.OpenAI]:
    folder = thinking_model[0]
    flags = ("--model", str(folder), "--reasoning-parser", "qwen3", "--num-kv-blocks", "64")
    process = ServerProcess(*flags, "--dtype", "float32")
    try:
        yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", timeout=300)
    finally:
        process.stop()


def _chat(client: openai.OpenAI, messages: list[dict], bias: dict[int, int], **fields):
    fields.setdefault("max_tokens", 8)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        response_format=RESPONSE_FORMAT,
        temperature=0,
        logit_bias={str(token_id): value for token_id, value in bias.items()},
        **fields,
    ).choices[0]


def test_the_reply_may_think_before_its_constrained_answer(client, thinking_model):
    _, open_id, _ = thinking_model
    # The first token opens the block; inside it the tag is free text, which the schema forbids.
    choice = _chat(client, [{"role": "user", "content": "Is it?"}], {open_id: 100})
    assert choice.finish_reason == "length"
    assert choice.message.reasoning == "<think>" * 7 and not choice.message.content


def test_after_the_block_the_answer_keeps_to_the_schema(client, thinking_model):
    _, open_id, close_id = thinking_model
    # A prefill left the block open; the reply closes it, then the schema holds (the tags are
    # masked there however strongly they are biased).
    messages = [
        {"role": "user", "content": "Is it?"},
        {"role": "assistant", "content": "<think>Let me see."},
    ]
    choice = _chat(
        client,
        messages,
        {close_id: 100, open_id: 90},
        max_tokens=32,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_ids": True,
        },
    )
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"][0] == close_id  # the reply closed the block
    assert json.loads(choice.message.content) in ({"ok": True}, {"ok": False})
