"""The whole engine on a CUDA device: tiny random models served through the Triton kernels (and
the torch backend) give Hugging Face `generate`'s greedy tokens, computed on the CPU in float32.

CI has no GPU, so these skip there; `benchmarks/gpu_check.sh` runs them on a lent CUDA machine.
They need no model files: a word-level tokenizer is built in memory (the engine only decodes ids).
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.engine.conftest import (
    TINY_VOCAB_SIZE,
    add_requests,
    assert_matches_reference,
    greedy_params,
    hf_greedy_reference,
    make_engine,
    make_tiny_model,
    run_to_completion,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LENGTHS = [1, 5, 16, 17, 64, 120]
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(TINY_VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="w0", bos_token="w1", eos_token="w2"
    )


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-gqa"])
@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens", "attention_backend"),
    [(16, 40, "triton"), (5, 2048, "triton"), (16, 40, "torch")],
    ids=["bs16-chunk40-triton", "bs5-unchunked-triton", "bs16-chunk40-torch"],
)
def test_tiny_model_on_cuda_equals_hf_generate(
    word_tokenizer, family, block_size, max_num_batched_tokens, attention_backend
):
    rng = random.Random(7)
    prompts = {
        f"p{length}": [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(length)]
        for length in PROMPT_LENGTHS
    }
    loaded = make_tiny_model(family, word_tokenizer)
    references = {
        rid: hf_greedy_reference(loaded.model, prompt, MAX_NEW_TOKENS)
        for rid, prompt in prompts.items()
    }
    loaded.model.to("cuda")
    engine = make_engine(
        loaded,
        device="cuda",
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        attention_backend=attention_backend,
        num_kv_blocks=4096 // block_size,
    )
    assert engine.cache_engine.device.type == "cuda"
    add_requests(engine, prompts, greedy_params(MAX_NEW_TOKENS))
    run = run_to_completion(engine)
    for request_id, reference in references.items():
        assert_matches_reference(
            run.token_ids[request_id],
            reference,
            f"{family} cuda {attention_backend} bs={block_size} {request_id}",
        )
