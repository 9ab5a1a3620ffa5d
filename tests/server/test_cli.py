"""The `pagedserve` CLI: flags derived from the config, their defaults, and their precedence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.configs.engine import SECTIONS
from pagedserve.server.cli import build_parser, config_from_args, main
from tests.server_process import REPO_ROOT, free_port

BRIEF_FLAGS = [
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--api-key",
    "--block-size",
    "--num-kv-blocks",
    "--kv-cache-memory",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--preemption-mode",
    "--dtype",
    "--device",
    "--attention-backend",
    "--seed",
    "--max-request-body-bytes",
    "--log-level",
    "--config",
]


def _serve_help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrap argparse's line breaks


def test_serve_help_lists_every_flag(capsys):
    text = _serve_help(capsys)
    for flag in BRIEF_FLAGS:
        assert flag in text
    for section in SECTIONS.values():
        for name in section.model_fields:
            assert "--" + name.replace("_", "-") in text


def test_serve_help_shows_defaults_and_descriptions(capsys):
    text = _serve_help(capsys)
    assert "tokens per KV block (default: 16)" in text
    assert "{recompute}" in text and "(default: recompute)" in text
    assert "bind port (default: 8000)" in text


def test_cli_flag_beats_environment():
    args = build_parser().parse_args(["serve", "--port", "9000"])
    config = config_from_args(
        args, environ={"PAGEDSERVE_PORT": "8001", "PAGEDSERVE_BLOCK_SIZE": "32"}
    )
    assert config.server.port == 9000
    assert config.cache.block_size == 32  # not given on the command line: the env var holds


def test_only_given_flags_reach_the_loader():
    args = build_parser().parse_args(
        ["serve", "--no-enable-prefix-caching", "--preemption-mode", "recompute"]
    )
    config = config_from_args(args, environ={})
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.preemption_mode == "recompute"
    assert config.cache.block_size == 16


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    args = build_parser().parse_args(["serve", "/models/qwen", "--port", "9000"])
    assert config_from_args(args, environ={}).model.model == "/models/qwen"
    args = build_parser().parse_args(["serve", "/models/qwen", "--model", "/models/qwen"])
    assert config_from_args(args, environ={}).model.model == "/models/qwen"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/models/a", "--model", "/models/b"])
    assert exit_info.value.code == 2
    assert "two models given" in capsys.readouterr().err


def test_invalid_setting_exits_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--block-size", "0", "--max-num-seqs", "0"])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # one line naming both fields
    assert "cache.block_size: " in last_line and "scheduler.max_num_seqs: " in last_line


def test_a_yaml_syntax_error_is_a_usage_error_naming_the_line(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("cache:\n  block_size: [1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(config)])
    assert exit_info.value.code == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_generate_checks_its_sampling_arguments_before_loading_the_model(capsys, monkeypatch):
    monkeypatch.setattr(
        "pagedserve.server.cli._generate", lambda *args: pytest.fail("the model was loaded")
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--max-tokens", "-1"])
    assert exit_info.value.code == 2
    assert "max_tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"), [([], None), (["--max-num-batched-tokens", "512"], 512)]
)
def test_generate_passes_only_the_settings_given(monkeypatch, flags, expected):
    # A flag equal to the server's default is still the user's choice: LLM's own (offline)
    # default must not replace it.
    seen = {}

    class StopAtLoad(Exception):
        pass

    def fake_llm(model, **engine_args):
        seen.update(engine_args)
        raise StopAtLoad

    monkeypatch.setattr("pagedserve.engine.llm.LLM", fake_llm)
    with pytest.raises(StopAtLoad):
        main(["generate", "hi", *flags])
    assert seen.get("max_num_batched_tokens") == expected


def test_bench_rejects_unknown_benchmarks(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_bad_speculative_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "scheduler.speculative_config.num_speculative_tokens" in last_line


def test_serve_help_never_shows_a_none_default(capsys):
    # Optional settings say what their absence means in their own words.
    text = _serve_help(capsys)
    assert "(default: None)" not in text
    assert "responses report; default: the model name)" in " ".join(text.split())


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["replicas", "-n", "1"]])
@pytest.mark.parametrize("flag", ["--model", "--tokenizer"])
def test_a_model_that_is_nowhere_is_a_usage_error_before_anything_starts(
    capsys, monkeypatch, tmp_path, command, flag
):
    for started in ("_serve", "_generate"):
        monkeypatch.setattr(f"pagedserve.server.cli.{started}", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exit_info:
        main([*command, flag, str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag[2:]} '{tmp_path / 'nowhere'}' is not a local folder" in last_line


def test_a_setting_the_engine_refuses_at_startup_is_one_line_and_exit_status_3():
    # The model loads, then the engine refuses the budget: uvicorn's startup failure, whose
    # traceback is cut to its last line (server/cli.py, _StartupErrorInOneLine).
    command = [sys.executable, "-m", "pagedserve.server", "serve", "--device", "cpu"]
    command += ["--kv-cache-memory", "100", "--port", str(free_port()), "--log-level", "warning"]
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environ)
    assert done.returncode == 3
    assert "ValueError: the KV cache budget (100 bytes) holds no block" in done.stderr
    assert "Traceback" not in done.stderr and "Application startup failed" in done.stderr


@pytest.mark.parametrize(
    ("template", "message"),
    [("/no/such/chat.jinja", "cannot read"), ("{% if %}", "does not parse")],
)
def test_a_chat_template_that_cannot_be_used_is_a_usage_error_before_anything_starts(
    capsys, monkeypatch, template, message
):
    monkeypatch.setattr("pagedserve.server.cli._serve", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--chat-template", template])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], True),
        (["--no-log-requests"], False),
        (["--disable-log-requests"], False),  # vLLM's names, which its scripts pass
        (["--enable-log-requests"], True),
    ],
)
def test_request_logging_takes_vllm_s_flags_too(flags, expected):
    args = build_parser().parse_args(["serve", *flags])
    assert config_from_args(args, environ={}).server.log_requests is expected
