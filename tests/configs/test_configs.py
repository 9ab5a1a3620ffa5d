"""Configuration: source precedence, shipped presets, strict validation, byte sizes, SamplingParams."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from pagedserve.configs.engine import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    parse_bytes,
)
from pagedserve.configs.loader import PRESETS_DIR, load_engine_config
from pagedserve.configs.sampling import SamplingParams, SamplingParamsError
from pagedserve.configs.stop_regex import compile_stop_regex, max_match_chars

PRESETS = ("cpu-small", "cpu-large", "gpu-h200")


@pytest.fixture
def block_size_file(tmp_path: Path) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text("cache:\n  block_size: 8\nscheduler:\n  max_num_seqs: 3\n")
    return path


def test_defaults_apply_when_no_source_sets_a_value():
    assert load_engine_config(environ={}) == EngineConfig()
    assert load_engine_config(environ={}).cache.block_size == 16


def test_file_overrides_defaults(block_size_file: Path):
    config = load_engine_config(config_file=block_size_file, environ={})
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (8, 3)


def test_env_overrides_file(block_size_file: Path):
    config = load_engine_config(
        config_file=block_size_file, environ={"PAGEDSERVE_BLOCK_SIZE": "32"}
    )
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 3)


def test_cli_overrides_env_and_file(block_size_file: Path):
    config = load_engine_config(
        cli={"block_size": 64, "max_num_seqs": None},
        config_file=block_size_file,
        environ={"PAGEDSERVE_BLOCK_SIZE": "32"},
    )
    assert config.cache.block_size == 64
    assert config.scheduler.max_num_seqs == 3  # a flag left at None was not given


def test_process_environment_is_read_by_default(block_size_file: Path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_BLOCK_SIZE", "32")
    monkeypatch.setenv("PAGEDSERVE_CONFIG", str(block_size_file))
    monkeypatch.setenv("PAGEDSERVE_CACHE", "/tmp/not-a-setting")
    config = load_engine_config()
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 3)


def test_env_strings_are_coerced_to_field_types():
    config = load_engine_config(
        environ={
            "PAGEDSERVE_ENABLE_PREFIX_CACHING": "false",
            "PAGEDSERVE_GPU_MEMORY_UTILIZATION": "0.5",
            "PAGEDSERVE_PORT": "9000",
        }
    )
    assert config.cache.enable_prefix_caching is False
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.server.port == 9000


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_loads_by_name_and_path(preset: str):
    by_name = load_engine_config(config_file=preset, environ={})
    assert by_name == load_engine_config(config_file=PRESETS_DIR / f"{preset}.yaml", environ={})
    assert by_name.model.model == "SmolLM2-135M-Instruct"
    budget = by_name.cache.kv_cache_memory
    assert budget == "auto" or parse_bytes(budget) > 0


def test_presets_match_their_hardware():
    small, large, h200 = (load_engine_config(config_file=preset, environ={}) for preset in PRESETS)
    assert small.model.device == "cpu" and small.model.dtype == "float32"
    assert large.scheduler.max_num_seqs > small.scheduler.max_num_seqs
    assert h200.model.device == "cuda" and h200.model.dtype == "bfloat16"
    assert h200.cache.attention_backend == "triton"


def test_unknown_file_setting_is_rejected_with_its_name(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("block_sise: 8\n")
    with pytest.raises(ValueError, match="unknown setting 'block_sise'"):
        load_engine_config(config_file=path, environ={})


def test_unknown_setting_inside_a_section_is_rejected_with_its_name(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("cache:\n  bogus: 1\n")
    with pytest.raises(ValueError, match="bogus"):
        load_engine_config(config_file=path, environ={})


def test_setting_in_the_wrong_section_is_rejected(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  block_size: 8\n")
    with pytest.raises(ValueError, match="'block_size' is not a field of section 'server'"):
        load_engine_config(config_file=path, environ={})


def test_unknown_env_setting_is_rejected_with_the_variable_name():
    with pytest.raises(ValueError, match="PAGEDSERVE_BLOK_SIZE"):
        load_engine_config(environ={"PAGEDSERVE_BLOK_SIZE": "8"})


def test_an_empty_api_key_means_no_authentication():
    assert load_engine_config(environ={"PAGEDSERVE_API_KEY": ""}).server.api_key is None
    assert load_engine_config(environ={"PAGEDSERVE_API_KEY": "k"}).server.api_key == "k"


def test_kv_cache_memory_takes_a_plain_byte_count(tmp_path):
    path = tmp_path / "bytes.yaml"
    path.write_text("cache:\n  kv_cache_memory: 1073741824\n")
    assert (
        parse_bytes(load_engine_config(config_file=path, environ={}).cache.kv_cache_memory)
        == 1 << 30
    )
    config = load_engine_config(cli={"kv_cache_memory": 1 << 20}, environ={})
    assert parse_bytes(config.cache.kv_cache_memory) == 1 << 20


def test_unknown_cli_flag_is_rejected():
    with pytest.raises(ValueError, match="unknown setting 'blok_size'"):
        load_engine_config(cli={"blok_size": 8}, environ={})


@pytest.mark.parametrize(
    ("settings", "budget"),
    [
        ({}, 512),  # chunked prefill on: the budget as given
        ({"enable_chunked_prefill": False}, 2048),  # off and unset: a whole max_model_len prompt
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}, 4096),
    ],
)
def test_the_step_budget_for_a_model_length(settings: dict, budget: int):
    config = load_engine_config(cli=settings, environ={})
    assert config.scheduler.for_model_len(2048).max_num_batched_tokens == budget


@pytest.mark.parametrize("source", ["cli", "env"])
def test_without_chunked_prefill_a_budget_below_the_model_length_is_refused(source: str):
    # vLLM's check: no prompt longer than the budget could ever run (it would wait forever).
    if source == "cli":
        config = load_engine_config(
            cli={"enable_chunked_prefill": False, "max_num_batched_tokens": 1024}, environ={}
        )
    else:
        config = load_engine_config(
            environ={
                "PAGEDSERVE_ENABLE_CHUNKED_PREFILL": "false",
                "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS": "1024",
            }
        )
    with pytest.raises(
        ValueError,
        match=r"max_num_batched_tokens \(1024\) is smaller than "
        r"max_model_len \(2048\)",
    ):
        config.scheduler.for_model_len(2048)


def test_out_of_range_value_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="block_size"):
        load_engine_config(environ={"PAGEDSERVE_BLOCK_SIZE": "0"})


def test_kv_cache_dtype_defaults_to_the_model_dtype_and_rejects_unknown_names():
    assert load_engine_config(environ={}).cache.kv_cache_dtype == "auto"
    config = load_engine_config(environ={"PAGEDSERVE_KV_CACHE_DTYPE": "fp8"})
    assert config.cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load_engine_config(cli={"kv_cache_dtype": "int4"}, environ={})


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("1048576", 1048576),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        (" 4 kib ", 4096),
        ("0", 0),
        (123, 123),
    ],
)
def test_byte_sizes_parse(text: str | int, num_bytes: int):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["", "MiB", "-1GiB", "12XB", "1e9", "2 GiB extra"])
def test_bad_byte_sizes_are_rejected(text: str):
    with pytest.raises(ValueError, match="cannot parse a byte size"):
        parse_bytes(text)


@pytest.mark.parametrize("budget", ["0", "0GiB", "0.0000001KiB", 0])
def test_cache_config_rejects_a_budget_of_no_bytes_before_any_model_loads(budget):
    with pytest.raises(ValueError, match="holds no KV block"):
        CacheConfig(kv_cache_memory=budget)


def test_cache_config_rejects_unparseable_memory_budget():
    with pytest.raises(ValueError, match="kv_cache_memory"):
        CacheConfig(kv_cache_memory="lots")


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.1),
        ("temperature", 101.0),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("n", 0),
        ("n", 17),
        ("max_tokens", -5),
        ("logprobs", -1),  # the upper cap is the engine's (--max-logprobs)
        ("prompt_logprobs", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", math.inf),
        ("repetition_penalty", 0.0),
        ("seed", -1),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {5: 101.0}),
        ("stop", ("",)),
        ("stop", tuple(str(i) for i in range(17))),
        ("stop_token_ids", (-1,)),
        ("allowed_token_ids", ()),
        ("allowed_token_ids", (3, -1)),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(param: str, value: object):
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**{param: value})
    assert raised.value.param == param
    assert param in str(raised.value) or param in ("stop", "stop_token_ids")


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert raised.value.param == "min_tokens"


def test_sampling_params_accept_boundary_values():
    params = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, n=16, max_tokens=1, logprobs=20, seed=0
    )
    assert params.is_greedy
    assert SamplingParams(logprobs=0, top_k=0).logprobs == 0


def test_sampling_params_are_immutable():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]


def test_kv_cache_memory_defaults_to_auto_and_accepts_it_in_any_case():
    assert CacheConfig().kv_cache_memory == "auto"
    assert CacheConfig(kv_cache_memory="AUTO").kv_cache_memory == "AUTO"
    assert CacheConfig(kv_cache_memory="2GiB").kv_cache_memory == "2GiB"


def test_lora_modules_are_name_path_pairs_named_once_apart_from_the_model():
    config = ModelConfig(enable_lora=True, lora_modules=["sql=/a/sql", "chat=/a/chat"])
    assert config.lora_adapters == {"sql": "/a/sql", "chat": "/a/chat"}
    from_env = load_engine_config(
        environ={"PAGEDSERVE_ENABLE_LORA": "1", "PAGEDSERVE_LORA_MODULES": "a=/x b=/y"}
    )
    assert from_env.model.lora_adapters == {"a": "/x", "b": "/y"}
    runtime = {"PAGEDSERVE_ENABLE_LORA": "1", "PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    assert load_engine_config(environ=runtime).model.allow_runtime_lora_updating
    for settings, message in [
        ({"lora_modules": ["sql=/a"]}, "need enable_lora"),
        ({"allow_runtime_lora_updating": True}, "need enable_lora"),
        ({"enable_lora": True, "lora_modules": ["sql=/a", "sql=/b"]}, "each name once"),
        ({"enable_lora": True, "lora_modules": ["sql"]}, "name=path"),
        ({"enable_lora": True, "lora_modules": ["m=/a"], "served_model_name": "m"}, "unreachable"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**settings)


def test_served_model_name_is_one_name_or_several():
    assert load_engine_config(
        cli={"served_model_name": "a"}, environ={}
    ).model.served_model_names == ("a",)
    config = load_engine_config(cli={"served_model_name": ["a", "b"]}, environ={})
    assert config.model.served_model_names == ("a", "b")
    environ = {"PAGEDSERVE_SERVED_MODEL_NAME": "c"}
    assert load_engine_config(environ=environ).model.served_model_names == ("c",)
    assert load_engine_config(environ={}).model.served_model_names == (DEFAULT_MODEL,)


@pytest.mark.parametrize(
    ("pattern", "widest"),
    [
        (r"\n\n", 2),
        ("(?i)end", 3),
        (r"[A-D]\)", 2),
        (r"a{2,5}b", 6),
        (r"\d+", None),  # unbounded: nothing is held back for it
        ("x.*y", None),
        ("(ab){1,600}", None),  # past MAX_BOUNDED_MATCH_CHARS
        (r"\pL", None),  # RE2 syntax Python cannot parse: taken as unbounded
    ],
)
def test_the_longest_match_of_a_stop_pattern(pattern: str, widest: int | None):
    assert max_match_chars(pattern) == widest
    compile_stop_regex(pattern)  # RE2 takes every one of them


@pytest.mark.parametrize("pattern", [r"\b", r"x*\b", r"(?:abc)?\b", "$", "^", r"(?i)a?"])
def test_a_stop_pattern_that_can_match_the_empty_string_is_refused(pattern: str):
    # Each matches zero characters somewhere (at a word boundary, the end...): it would end an
    # output before any text of its own.
    with pytest.raises(SamplingParamsError, match="can match the empty string") as error:
        SamplingParams(stop_regex=(pattern,))
    assert error.value.param == "stop_regex"


def test_a_posix_class_pattern_compiles_without_a_warning():
    # Python's parser (asked only for the match's width) warns about RE2's [[:digit:]]; that
    # must not reach the server's log.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SamplingParams(stop_regex=("[[:digit:]]{2}",))
