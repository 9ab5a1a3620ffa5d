"""The `pagedserve` command: `serve` (HTTP server), `generate` (one offline prompt), `run-batch`
(a file of requests, offline), `replicas`, `bench NAME`.

Engine flags are derived from the pydantic config fields, so `--help` always matches the config.
Only flags the user actually gave reach `load_engine_config`, which keeps its precedence
(CLI > `PAGEDSERVE_*` env > config file > defaults) intact.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError

from pagedserve.configs import EngineConfig, SamplingParams, SamplingParamsError, load_engine_config
from pagedserve.configs.engine import SECTIONS
from pagedserve.server.app import begin_shutdown, create_app

BENCHMARKS = (
    "throughput",
    "serving",
    "memory",
    "step",
    "attention",
    "block_pool",
    "replicas",
    "structured",
    "engine_state",
    "spec_decode",
    "prompt_logprobs",
    "peers",
)
ENGINE_SECTIONS = ("model", "cache", "scheduler")
CONFIG_FIELDS = frozenset(name for section in SECTIONS.values() for name in section.model_fields)
DEFAULT_GRACEFUL_SHUTDOWN_S = 10.0
SHORT_FLAGS = {  # vLLM's
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
}


def _flag_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse `type`/`choices`/`action` for a config field's annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is list:  # --lora-modules a=/x b=/y, as vLLM's
        return {"nargs": "+", "type": str}
    return {"type": annotation if annotation in (int, float) else str}


def _add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str]) -> None:
    for section in sections:
        group = parser.add_argument_group(f"{section} settings")
        for name, field in SECTIONS[section].model_fields.items():
            description = (field.description or "").replace("%", "%%")
            # A None default is explained by the description ("default: the model name").
            if field.default is not None and "(default" not in description:
                description += f" (default: {field.default})"
            group.add_argument(
                "--" + name.replace("_", "-"),
                *SHORT_FLAGS.get(name, ()),
                dest=name,
                default=argparse.SUPPRESS,  # absent unless given: see the module docstring
                help=description,
                **_flag_kwargs(field.annotation),
            )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML config file or preset name (default: $PAGEDSERVE_CONFIG)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        default=argparse.SUPPRESS,
        help="the model to serve, as `vllm serve MODEL` takes it (the same as --model)",
    )
    _add_config_flags(serve, list(SECTIONS))
    _add_vllm_log_flags(serve)
    serve.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_GRACEFUL_SHUTDOWN_S,
        help="on SIGTERM, how long open requests may still run before they are "
        f"ended with a final event (default: {DEFAULT_GRACEFUL_SHUTDOWN_S})",
    )

    generate = commands.add_parser("generate", help="complete one prompt offline and print it")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64, help="(default: 64)")
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)"
    )
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    _add_config_flags(generate, ENGINE_SECTIONS)

    _add_replicas_parser(commands)

    run_batch = commands.add_parser(
        "run-batch",
        help="answer a JSONL file of requests in OpenAI's batch format offline (vLLM's run-batch)",
        description="Other flags are `serve` flags (the model, the engine, parsers, templates).",
    )
    run_batch.add_argument(
        "-i", "--input-file", required=True, help="the requests (JSONL; a path or an http(s) URL)"
    )
    run_batch.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="the answers (JSONL; a path, or an http(s) URL the file is PUT to at the end)",
    )
    _add_config_flags(run_batch, list(SECTIONS))
    _add_vllm_log_flags(run_batch)

    bench = commands.add_parser("bench", help="run a benchmark: benchmarks.<NAME>.main(args)")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return parser


# vLLM's names for some of our boolean flags, which its deployment scripts pass: flag -> (our
# config field, the value the flag sets).
VLLM_FLAG_ALIASES = {
    "--enable-log-requests": ("log_requests", True),
    "--disable-log-requests": ("log_requests", False),
    "--disable-log-stats": ("log_stats", False),
    "--disable-uvicorn-access-log": ("uvicorn_access_log", False),
    "--disable-fastapi-docs": ("fastapi_docs", False),
}


def _add_vllm_log_flags(parser: argparse.ArgumentParser) -> None:
    """VLLM_FLAG_ALIASES, as flags of `parser`."""
    for flag, (field, value) in VLLM_FLAG_ALIASES.items():
        ours = field.replace("_", "-")
        parser.add_argument(
            flag,
            dest=field,
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"vLLM's name for --{'' if value else 'no-'}{ours}",
        )


def _add_replicas_parser(commands: Any) -> None:
    from pagedserve.server.replicas import POLICIES  # light: no torch, no router

    replicas = commands.add_parser(
        "replicas",
        help="N servers, each on an equal share of the cores, behind sglang-router on --port",
        description="Other flags are `serve` flags, given to every replica.",
    )
    replicas.add_argument("-n", "--num-replicas", type=int, default=2, help="(default: 2)")
    replicas.add_argument("--host", default="127.0.0.1", help="router bind address")
    replicas.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    replicas.add_argument("--policy", choices=POLICIES, default="cache_aware")
    replicas.add_argument("--log-dir", default=None, help="(default: a new temporary folder)")


def _replicas(parser: argparse.ArgumentParser, args: argparse.Namespace, serve_args: list[str]):
    import tempfile

    from pagedserve.server.replicas import ReplicasError, run

    # The replicas' flags are checked here once, not N times in N crashing children.
    config = _checked_config(parser, parser.parse_args(["serve", *serve_args]))
    if args.num_replicas < 1:
        parser.error(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if config.server.uds is not None:
        parser.error("--uds: replicas listen on ports of their own, behind the router's --port")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pagedserve-replicas-")
    try:
        sys.exit(
            run(
                args.num_replicas,
                args.host,
                args.port,
                args.policy,
                serve_args,
                log_dir,
                config.server.api_key,
            )
        )
    except ReplicasError as exc:
        sys.stderr.write(f"pagedserve replicas: {exc}\n")
        sys.exit(1)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> EngineConfig:
    given = {name: value for name, value in vars(args).items() if name in CONFIG_FIELDS}
    if "model_tag" in vars(args):
        if given.get("model", args.model_tag) != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag} and --model {given['model']}")
        given["model"] = args.model_tag
    return load_engine_config(cli=given, config_file=args.config, environ=environ)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which tells the app when shutdown starts: open requests then get
    `grace_s` seconds and are ended by the app with a final event, before uvicorn's own timeout
    (a backstop) would cancel them mid-send."""

    def __init__(self, config: uvicorn.Config, grace_s: float) -> None:
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        begin_shutdown(self.config.app, self.grace_s)
        await super().shutdown(sockets)


class _StartupErrorInOneLine(logging.Filter):
    """uvicorn logs a failed startup's whole traceback, as Starlette formats it: dozens of lines
    for a setting the engine refused ('ValueError: the KV cache budget (100 bytes) holds no
    block...'). The traceback's last line names the problem; `--log-level debug` keeps it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Traceback (most recent call last):"):
            record.msg, record.args = message.strip().splitlines()[-1], ()
        return True


def uvicorn_config(app: Any, config: EngineConfig, grace_s: float) -> uvicorn.Config:
    """uvicorn's settings for serving `app` as `config.server` says."""
    server = config.server
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        uds=server.uds,
        log_level=server.uvicorn_log_level or server.log_level,
        access_log=server.uvicorn_access_log,
        timeout_graceful_shutdown=grace_s + 5,
        root_path=server.root_path,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
    )


def _serve(args: argparse.Namespace, config: EngineConfig) -> None:
    grace_s = args.timeout_graceful_shutdown
    server = GracefulServer(uvicorn_config(create_app(config), config, grace_s), grace_s)
    if config.server.log_level != "debug":  # after uvicorn.Config, which configures its loggers
        logging.getLogger("uvicorn.error").addFilter(_StartupErrorInOneLine())
    # uvicorn re-raises a captured SIGTERM once its graceful shutdown is done; the default handler
    # would then kill us with status 143 although the shutdown was clean.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    server.run()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: startup failed (e.g. the model could not be loaded)


def _generate(args: argparse.Namespace, config: EngineConfig, params: SamplingParams) -> None:
    from pagedserve.engine.llm import LLM  # imports torch: only when needed

    engine_kwargs = {
        name: value
        for section in ENGINE_SECTIONS
        for name, value in getattr(config, section).model_dump(exclude_unset=True).items()
    }
    engine_kwargs.pop("model", None)
    # One sequence runs: the "auto" KV budget then sizes itself for one request at max_model_len
    # (180 MiB for the default model) instead of faulting in 4 GiB, 7 s of a one-off start.
    engine_kwargs.setdefault("max_num_seqs", 1)
    llm = LLM(model=config.model.model, **engine_kwargs)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    (output,) = llm.generate([prompt], params)
    sys.stdout.write(output.outputs[0].text + "\n")


def _checked_batch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Any]:
    """The input file's requests, read before the model loads (a bad line: one error line)."""
    from pathlib import Path

    import httpx

    from pagedserve.server.run_batch import BatchInputError, is_url, read_batch

    output = Path(args.output_file).resolve()
    if is_url(args.output_file):  # uploaded at the end (a PUT): a malformed URL fails now
        try:
            httpx.URL(args.output_file)
        except httpx.InvalidURL as exc:
            parser.error(f"the output URL is not valid: {exc}")
    elif output.is_dir():
        parser.error(f"the output file is a folder: {args.output_file}")
    elif not output.parent.is_dir() or not os.access(output.parent, os.W_OK):
        parser.error(f"the output file's folder does not exist or is not writable: {output.parent}")
    try:
        return read_batch(args.input_file)
    except BatchInputError as exc:
        parser.error(str(exc))


def _largest_body(batch: list[Any]) -> int:
    """The longest request body of the batch, as it is sent."""
    from pagedserve.server.run_batch import encoded_body

    return max((len(encoded_body(request)) for request in batch), default=0)


def _run_batch(args: argparse.Namespace, config: EngineConfig, batch: list[Any]) -> None:
    import asyncio

    from pagedserve.server.run_batch import run_batch

    quiet = config.server.log_level != "debug"  # progress lines, not one line per request
    if quiet:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger(__name__).info(
        "run-batch: %d requests from %s to %s", len(batch), args.input_file, args.output_file
    )
    # The file is the user's own: any line may be as long as it is (the server's body limit
    # guards a public endpoint).
    body_limit = max(config.server.max_request_body_bytes, _largest_body(batch))
    log_requests = config.server.log_requests if "log_requests" in vars(args) else not quiet
    server = config.server.model_copy(
        update={"max_request_body_bytes": body_limit, "log_requests": log_requests}
    )
    app = create_app(config.model_copy(update={"server": server}))
    stopped_by: list[int] = []

    def stop(signum: int, frame: Any) -> None:  # SIGTERM (docker, kubernetes) as Ctrl-C
        stopped_by.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        failed = asyncio.run(run_batch(app, batch, args.output_file, config.server.api_key))
    except KeyboardInterrupt:
        sys.stderr.write("pagedserve run-batch: stopped; the output file was not written\n")
        sys.exit(128 + (stopped_by[0] if stopped_by else signal.SIGINT))
    except Exception as exc:  # the engine did not start, or stopped: nothing was written
        sys.stderr.write(f"pagedserve run-batch: {type(exc).__name__}: {exc}\n")
        sys.exit(1)
    logging.getLogger(__name__).info(
        "run-batch: wrote %s (%d of %d requests answered with an error)",
        args.output_file,
        failed,
        len(batch),
    )


def _check_default_template_kwargs(config: EngineConfig) -> None:
    """Before the model loads: --default-chat-template-kwargs naming how a template is applied
    (the app checks again against the model's own tokenizer once it is loaded)."""
    from transformers import PreTrainedTokenizerBase

    from pagedserve.server.prompts import check_default_template_kwargs

    defaults = config.server.default_chat_template_kwargs
    check_default_template_kwargs(PreTrainedTokenizerBase, defaults)


def _checked_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    try:
        config = config_from_args(args)
        if args.command in ("serve", "generate", "run-batch"):
            from pagedserve.engine.chat_template import read_chat_template
            from pagedserve.engine.model_loader import check_model_found  # imports torch

            check_model_found(config.model)  # a typo: one line here, not a traceback later
            if config.model.chat_template is not None:
                read_chat_template(config.model.chat_template)
            _check_default_template_kwargs(config)
        return config
    except ValidationError as exc:  # one line per run, naming each field
        parser.error(
            "invalid configuration: "
            + "; ".join(
                f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                for error in exc.errors()
            )
        )
    except (ValueError, OSError) as exc:
        parser.error(f"invalid configuration: {exc}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "replicas":
        _replicas(parser, args, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":
        result = importlib.import_module(f"pagedserve.benchmarks.{args.name}").main(args.args)
        sys.exit(result if isinstance(result, int) else 0)
    config = _checked_config(parser, args)
    batch = _checked_batch(parser, args) if args.command == "run-batch" else None
    params = None
    if args.command == "generate":  # checked before the model loads
        try:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        except SamplingParamsError as exc:
            parser.error(str(exc))
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        _serve(args, config)
    elif args.command == "run-batch":
        _run_batch(args, config, batch)
    else:
        _generate(args, config, params)
