"""The KV budget: sized from the memory the machine has unless the user gives one."""

from __future__ import annotations

import logging

import pytest

from pagedserve.configs import load_engine_config
from pagedserve.engine.memory import (
    CPU_AUTO_CAP_BYTES,
    CPU_FALLBACK_BYTES,
    auto_cpu_kv_budget,
    make_cache_spec,
    mem_available_bytes,
)
from tests.engine.conftest import make_tiny_model

GIB = 2**30


def test_auto_budget_is_a_quarter_of_what_is_available_after_activations():
    budget, reason = auto_cpu_kv_budget(10 * GIB, 2 * GIB, max_useful=100 * GIB)
    assert budget == 2 * GIB  # (10 - 2) / 4
    assert "2.00 GiB" in reason and "10.00 GiB available" in reason


def test_auto_budget_is_capped_on_a_large_machine_and_by_what_requests_can_use():
    assert auto_cpu_kv_budget(500 * GIB, GIB, max_useful=100 * GIB)[0] == CPU_AUTO_CAP_BYTES
    assert auto_cpu_kv_budget(500 * GIB, GIB, max_useful=3 << 20)[0] == 3 << 20


def test_auto_budget_falls_back_to_the_old_fixed_size_when_memavailable_is_unknown():
    budget, reason = auto_cpu_kv_budget(None, GIB, max_useful=100 * GIB)
    assert budget == CPU_FALLBACK_BYTES and "unknown" in reason


def test_auto_budget_is_zero_when_activations_take_everything():
    assert auto_cpu_kv_budget(GIB, 2 * GIB, max_useful=100 * GIB)[0] == 0


def test_mem_available_is_read_from_meminfo_in_kilobytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:     2048 kB\n")
    assert mem_available_bytes(str(meminfo)) == 2048 * 1024
    meminfo.write_text("MemTotal:       1000 kB\n")
    assert mem_available_bytes(str(meminfo)) is None
    assert mem_available_bytes(str(tmp_path / "missing")) is None


@pytest.fixture(scope="module")
def tiny_loaded(default_tokenizer):
    return make_tiny_model("llama-gqa", default_tokenizer)


def _engine(tiny_loaded, **settings):
    from pagedserve.engine.llm_engine import LLMEngine

    config = load_engine_config(cli={"device": "cpu", **settings}, environ={})
    return LLMEngine(config, loaded=tiny_loaded)


def test_default_engine_sizes_its_cache_from_the_machine_and_logs_budget_blocks_concurrency(
    tiny_loaded, caplog
):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        engine = _engine(tiny_loaded, max_num_seqs=4, block_size=16)
    spec = make_cache_spec(tiny_loaded.hf_config, tiny_loaded.model, 16)
    # The tiny model's cache is small: 4 requests at max_model_len bound the auto budget.
    max_useful_blocks = 4 * -(-engine.max_model_len // 16)
    assert engine.cache_engine.num_blocks == max_useful_blocks
    assert engine.cache_engine.num_bytes == max_useful_blocks * spec.bytes_per_block
    text = caplog.text
    assert "kv_cache_memory=auto" in text and "available" in text
    assert f"KV cache: {max_useful_blocks} blocks" in text and "max concurrency" in text


def test_an_explicit_kv_cache_memory_still_overrides_the_auto_budget(tiny_loaded):
    spec = make_cache_spec(tiny_loaded.hf_config, tiny_loaded.model, 16)
    engine = _engine(tiny_loaded, kv_cache_memory=str(10 * spec.bytes_per_block), block_size=16)
    assert engine.cache_engine.num_blocks == 10
