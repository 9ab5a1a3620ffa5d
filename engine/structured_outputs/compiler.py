"""`GrammarCompiler`: turns a request's `StructuredOutputs` into an xgrammar `CompiledGrammar` on a
small thread pool, off the engine thread, with an LRU cache keyed by the constraint.

Compiling needs the tokenizer's vocabulary (xgrammar's `TokenizerInfo`, ~0.3 s for 49k tokens);
it is built on first use, so an engine that never sees a constraint never pays for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar

from pagedserve.configs import StructuredOutputs
from pagedserve.engine.errors import EngineOverloadedError, InvalidRequestError
from pagedserve.engine.structured_outputs.limits import (
    COMPILE_TIMEOUT_S,
    check_limits,
    check_tag_limits,
    parsed_schema,
)
from pagedserve.engine.structured_outputs.schema_support import (
    invalid_keyword,
    unenforced_keyword,
)
from pagedserve.engine.structured_outputs.spelling import (
    describe,
    unspellable_in_choices,
    unspellable_in_pattern,
    vocabulary_bytes,
)
from pagedserve.engine.structured_outputs.structural_tag import (
    TagParts,
    compile_structural_tag,
    tag_parts,
)

logger = logging.getLogger(__name__)

# xgrammar prefixes its messages with "[time] /path/file.cc:line: " (and sometimes "Check
# failed: ... is false: "): the client gets the sentence that names what is wrong.
_ANY_OBJECT = '{"type": "object"}'
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. `submit` never blocks on a compile.

    Invariant: at most `max_cached` constraints are held (finished or in flight); a failed
    compile is replaced by a fresh one on the next `submit` (errors are not cached).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_threads: int = 2,
        max_cached: int = 256,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids beyond the tokenizer stay masked
        self._stop_token_ids = list(stop_token_ids)
        self._max_cached = max_cached
        self.timeout_s = COMPILE_TIMEOUT_S  # how long a request waits for its compile
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="pagedserve-grammar")
        self._lock = threading.Lock()  # guards the cache (taken on the event loop: never held long)
        self._compiler_lock = threading.Lock()  # guards the one-off TokenizerInfo build
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._spellable = frozenset(range(256))  # the bytes some token holds, set with _compiler
        self._cache: OrderedDict[StructuredOutputs, Future[xgrammar.CompiledGrammar]] = (
            OrderedDict()
        )

    def submit(self, constraint: StructuredOutputs) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar (a cached future, or a new compile on the pool). The future raises
        InvalidRequestError, naming `constraint.param`, when the constraint is malformed."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None and not _failed(future):
                self._cache.move_to_end(constraint)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = future
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return future

    def prepare(self) -> None:
        """Read the vocabulary now. HF fast tokenizers are not safe to use from two threads at
        once ("Already borrowed"): a server calls this before it tokenizes any request."""
        self._xgrammar_compiler()

    async def compiled(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """`submit`, awaited for at most `timeout_s`: then a 400 if the compile is running (too
        costly a constraint; its thread finishes in the background), a 429 if still queued behind
        others. Shielded from the waiter's cancellation (a client gone, or the timeout): the cached
        future may serve other requests with the same constraint."""
        future = self.submit(constraint)
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), self.timeout_s)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            if future.running():
                raise compile_timeout_error(constraint, self.timeout_s) from None
            raise EngineOverloadedError(
                "the grammar compiler is busy with other constraints; retry later"
            ) from None

    def compile(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """Blocking `submit` (the offline API), waiting at most `timeout_s`."""
        try:
            return self.submit(constraint).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:  # the builtin only from Python 3.11
            raise compile_timeout_error(constraint, self.timeout_s) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # Our LRU bounds memory; xgrammar's own cache is unbounded by default.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._spellable = vocabulary_bytes(info.decoded_vocab)
            return self._compiler

    def _compile(self, constraint: StructuredOutputs) -> xgrammar.CompiledGrammar:
        parts = tag_parts(constraint)  # a structural tag's: held to the same checks
        for part in (constraint, *parts.constraints):
            _check(part)
        if constraint.kind == "structural_tag":
            check_tag_limits(constraint, parts.constraints, parts.excludes)
        compiler = self._xgrammar_compiler()
        try:
            compiled = _compile_with(compiler, constraint)
        except (RuntimeError, ValueError, TypeError) as error:
            message = _native_message(error)
            logger.debug("constraint for %s rejected: %s", constraint.param, message)
            raise InvalidRequestError(
                f"invalid {_describe(constraint)} in {constraint.param}: {message}",
                constraint.param,
            ) from None
        self._check_spellable(constraint, compiled, parts)
        return compiled

    def _check_spellable(
        self, constraint: StructuredOutputs, compiled: xgrammar.CompiledGrammar, parts: TagParts
    ) -> None:
        """Refuse a constraint this vocabulary cannot follow: one that requires a character no
        token can spell (it would dead-end mid-output), or whose first step allows no token. A
        structural tag's regexes and grammars are read as alone, and its text (begins, ends,
        constant strings) must be spellable whole."""
        char = None
        for part in (constraint, *parts.constraints):
            if char is None and part.kind in ("regex", "grammar"):
                grammar = part.kind == "grammar"
                char = unspellable_in_pattern(str(part.spec), self._spellable, grammar=grammar)
        if constraint.kind == "choice":
            char = unspellable_in_choices(constraint.spec, self._spellable)
        for literal in parts.literals:
            char = char or unspellable_in_choices((literal,), self._spellable)
        if char is not None:
            problem = f"requires {describe(char)}, which no token of this model's vocabulary spells"
        elif not _allows_a_first_token(compiled):
            problem = "allows no token of this model's vocabulary as its first"
        else:
            return
        raise InvalidRequestError(
            f"the {_describe(constraint)} in {constraint.param} {problem}", constraint.param
        )


def _check(constraint: StructuredOutputs) -> None:
    """The limits and schema checks a constraint must pass before it is compiled."""
    schema = parsed_schema(constraint)
    check_limits(constraint, _describe(constraint), schema)
    reason = unenforced_keyword(schema)
    if reason is not None:
        raise InvalidRequestError(
            f"the JSON schema in {constraint.param} uses {reason}, which the structured-output "
            "compiler (xgrammar) does not enforce: the output could break the schema",
            constraint.param,
        )
    problem = invalid_keyword(schema)
    if problem is not None:
        raise InvalidRequestError(
            f"invalid JSON schema in {constraint.param}: {problem}", constraint.param
        )


def _compile_with(
    compiler: xgrammar.GrammarCompiler, constraint: StructuredOutputs
) -> xgrammar.CompiledGrammar:
    kind, spec = constraint.kind, constraint.spec
    # Compact JSON (no free whitespace): a small model left free to emit whitespace can run to
    # max_tokens in it. json_object is OpenAI's "a JSON object", not any JSON value.
    if kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if kind == "json":  # strict_mode: no properties or items beyond the schema's
        return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        return compile_structural_tag(compiler, spec)  # type: ignore[arg-type]
    return compiler.compile_grammar(choice_grammar(spec))


def choice_grammar(choices: str | tuple[str, ...]) -> str:
    """An EBNF grammar that matches exactly one of `choices` (JSON escapes are valid EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _allows_a_first_token(compiled: xgrammar.CompiledGrammar) -> bool:
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a shielded compile's outcome as seen: its waiter may be gone, and asyncio would log an
    exception nobody retrieved."""
    if not future.cancelled():
        future.exception()


def compile_timeout_error(constraint: StructuredOutputs, timeout_s: float) -> InvalidRequestError:
    return InvalidRequestError(
        f"the {_describe(constraint)} in {constraint.param} did not compile within "
        f"{timeout_s:g} s: simplify it",
        constraint.param,
    )


def _failed(future: Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


def _describe(constraint: StructuredOutputs) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON grammar",
        "regex": "regex",
        "grammar": "grammar",
        "choice": "choice",
        "structural_tag": "structural tag",
    }[constraint.kind]


def _native_message(error: Exception) -> str:
    lines = [_NATIVE_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    return next((line for line in lines if line), type(error).__name__)[:500]
