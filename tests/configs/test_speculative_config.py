"""--speculative-config: vLLM's JSON shape from the CLI, env or YAML, validated; off by default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedserve.configs import SpeculativeConfig
from pagedserve.configs.loader import load_engine_config

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def test_speculation_is_off_by_default():
    assert load_engine_config(environ={}).scheduler.speculative_config is None


def test_the_json_flag_builds_the_config():
    config = load_engine_config(cli={"speculative_config": NGRAM}, environ={})
    assert config.scheduler.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
    )


def test_the_environment_and_a_yaml_mapping_set_it_too(tmp_path):
    config = load_engine_config(environ={"PAGEDSERVE_SPECULATIVE_CONFIG": NGRAM})
    assert config.scheduler.speculative_config.num_speculative_tokens == 3
    path = tmp_path / "engine.yaml"
    path.write_text(
        "scheduler:\n  speculative_config:\n    method: ngram\n    num_speculative_tokens: 2\n"
    )
    config = load_engine_config(config_file=path, environ={})
    assert config.scheduler.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize("text", ["", "null", "none"])
def test_an_empty_value_means_off(text):
    config = load_engine_config(environ={"PAGEDSERVE_SPECULATIVE_CONFIG": text})
    assert config.scheduler.speculative_config is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "bogus"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 3}',
            "prompt_lookup_min (5) must be <= prompt_lookup_max (3)",
        ),
    ],
)
def test_bad_values_are_rejected_naming_the_problem(text, message):
    with pytest.raises(ValidationError, match="speculative_config") as error:
        load_engine_config(cli={"speculative_config": text}, environ={})
    assert message in str(error.value)
