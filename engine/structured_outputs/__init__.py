"""Structured outputs: grammar-constrained decoding with xgrammar (compile off the engine thread,
mask the logits of constrained rows before sampling, advance each choice's matcher after)."""

from pagedserve.engine.structured_outputs.compiler import GrammarCompiler
from pagedserve.engine.structured_outputs.manager import (
    GrammarError,
    GrammarRejectedError,
    Matcher,
    StructuredOutputManager,
)

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarRejectedError",
    "Matcher",
    "StructuredOutputManager",
]
