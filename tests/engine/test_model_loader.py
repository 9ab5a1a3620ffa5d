"""Model resolution and loading: local folders, the converted default model, offline errors.

The tests marked slow convert the real default model (about 20 s on 2 cores) into a session-scoped
temporary cache, so they never touch the user's `~/.cache/pagedserve`.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from pagedserve.configs.engine import DEFAULT_MODEL, ModelConfig
from pagedserve.engine import model_loader
from pagedserve.engine.model_loader import (
    ModelNotFoundError,
    load_model,
    resolve_dtype,
    resolve_model_path,
)


@pytest.fixture(scope="session")
def converted_cache(tmp_path_factory: pytest.TempPathFactory):
    """A pagedserve cache holding the converted default model, and how long converting took."""
    cache = tmp_path_factory.mktemp("pagedserve-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE", str(cache))
        started = time.monotonic()
        folder, converted = resolve_model_path(DEFAULT_MODEL)
        seconds = time.monotonic() - started
    assert converted
    yield cache, folder, seconds
    shutil.rmtree(cache, ignore_errors=True)  # ~540 MB; pytest would keep it for three sessions


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A random 2-layer Llama and a word-level tokenizer, saved as an ordinary HF folder."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]"
    ).save_pretrained(tmp_path)
    return tmp_path


def test_local_folder_is_used_as_is(tiny_model_dir: Path):
    assert resolve_model_path(str(tiny_model_dir)) == (tiny_model_dir.resolve(), False)


def test_load_model_from_local_folder_has_requested_dtype_and_shapes(tiny_model_dir: Path):
    loaded = load_model(ModelConfig(model=str(tiny_model_dir), dtype="bfloat16"), "cpu")
    assert loaded.model_path == tiny_model_dir.resolve()
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.hf_config.num_hidden_layers == 2
    assert loaded.tokenizer("hello world").input_ids == [1, 2]
    assert loaded.max_model_len == 64  # the model's limit caps the 4096 default


def test_load_model_caps_max_model_len_at_the_model_limit(tiny_model_dir: Path):
    assert (
        load_model(ModelConfig(model=str(tiny_model_dir), max_model_len=32), "cpu").max_model_len
        == 32
    )
    assert (
        load_model(ModelConfig(model=str(tiny_model_dir), max_model_len=1000), "cpu").max_model_len
        == 64
    )


def test_load_model_passes_attn_implementation(tiny_model_dir: Path):
    loaded = load_model(ModelConfig(model=str(tiny_model_dir)), "cpu", attn_implementation="eager")
    assert loaded.hf_config._attn_implementation == "eager"


# Flags as /proc/cpuinfo reports them: AMD Zen 2 (AVX2, no bf16) and Intel Sapphire Rapids.
ZEN2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS_FLAGS = ZEN2_FLAGS | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_auto_dtype_is_float32_on_a_cpu_without_native_bf16_and_bfloat16_where_it_has_it():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, ZEN2_FLAGS) == torch.float32
    assert resolve_dtype("auto", cpu, SAPPHIRE_RAPIDS_FLAGS) == torch.bfloat16
    assert resolve_dtype("auto", cpu, ZEN2_FLAGS | {"avx512_bf16"}) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), ZEN2_FLAGS) == torch.bfloat16
    assert resolve_dtype("float16", cpu, ZEN2_FLAGS) == torch.float16


def test_explicit_bfloat16_is_honoured_without_native_bf16_with_a_warning_naming_it(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.model_loader"):
        assert resolve_dtype("bfloat16", cpu, ZEN2_FLAGS) == torch.bfloat16
    assert "avx512_bf16 or amx_bf16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.model_loader"):
        assert resolve_dtype("bfloat16", cpu, SAPPHIRE_RAPIDS_FLAGS) == torch.bfloat16
        assert resolve_dtype("float32", cpu, ZEN2_FLAGS) == torch.float32
    assert caplog.text == ""


@pytest.mark.parametrize(
    "model", ["pagedserve-tests/no-such-model", "/no/such/folder", "no-such-model"]
)
def test_unknown_model_raises_a_clear_offline_error(model: str):
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_path(model)


def test_hub_id_in_the_local_hf_cache_resolves_to_its_snapshot(tmp_path: Path, monkeypatch):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("org/tiny") == (snapshot, False)


def test_concurrent_first_starts_publish_one_complete_folder(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    num_starts = 4
    barrier = threading.Barrier(num_starts)

    def slow_fake_conversion(models_dir: Path) -> Path:
        models_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.tmp-", dir=models_dir))
        barrier.wait()  # every start is converting before any publishes
        (staging / "config.json").write_text(f'{{"writer": {threading.get_ident()}}}')
        return staging

    monkeypatch.setattr(model_loader, "_convert_default_model", slow_fake_conversion)
    results: list[tuple[Path, bool]] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_path(DEFAULT_MODEL)))
        for _ in range(num_starts)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    folder = tmp_path / "models" / DEFAULT_MODEL
    assert {path for path, _ in results} == {folder}
    assert os.listdir(tmp_path / "models") == [DEFAULT_MODEL]  # no staging folder left behind
    assert (folder / "config.json").read_text().startswith('{"writer"')


def _refuse_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model loader opened a network connection")


@pytest.mark.slow
def test_default_model_converts_once_then_loads_fast_and_offline(converted_cache, monkeypatch):
    cache, folder, conversion_seconds = converted_cache
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(cache))
    monkeypatch.setattr(socket.socket, "connect", _refuse_network)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    loaded = load_model(ModelConfig(model=f"HuggingFaceTB/{DEFAULT_MODEL}"), "cpu")
    load_seconds = time.monotonic() - started
    print(f"default model: conversion {conversion_seconds:.1f} s, later load {load_seconds:.2f} s")
    assert resolve_model_path(DEFAULT_MODEL) == (folder, False)
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert loaded.model_path == folder
    assert load_seconds < conversion_seconds / 2


@pytest.mark.slow
def test_default_model_config_tokenizer_and_tied_embeddings(converted_cache, monkeypatch):
    cache, _, _ = converted_cache
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(cache))
    loaded = load_model(ModelConfig(dtype="float32"), "cpu")
    config = loaded.hf_config
    assert isinstance(config, LlamaConfig)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert not hasattr(config, "quantization_config")
    assert config.tie_word_embeddings
    assert (
        loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()
    )
    assert loaded.max_model_len == 4096
    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template
    assert (
        tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id == 2
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_converted_model_logits_equal_the_gguf_model(converted_cache, monkeypatch):
    cache, folder, _ = converted_cache
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(cache))
    gguf = model_loader._default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Hugging Face's own modules on both sides: this checks the converted weights, bit for bit.
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = load_model(ModelConfig(dtype="float32"), "cpu")
    input_ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = reference(input_ids).logits
        assert torch.equal(converted(input_ids).logits, expected)
        # The loader's CPU fast paths (fused norms, MLPs, attention; oneDNN and skinny linears)
        # on the same weights: float32 rounding apart.
        torch.testing.assert_close(loaded.model(input_ids).logits, expected, rtol=0, atol=5e-4)


CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
)


def test_the_loaded_tokenizer_renders_the_configured_chat_template(tiny_model_dir: Path, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    config = ModelConfig(model=str(tiny_model_dir), chat_template=str(path))
    tokenizer = load_model(config, "cpu").tokenizer
    conversation = [{"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text == "[user] hi there\n[assistant]"
