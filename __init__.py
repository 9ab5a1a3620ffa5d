"""pagedserve: a continuous-batching LLM inference server with a paged KV cache.

This file is the `pagedserve` package itself: the repository's top-level folders install as its
subpackages (`pagedserve.server`, `pagedserve.engine`, `pagedserve.scheduler`,
`pagedserve.cache`, `pagedserve.configs`, `pagedserve.benchmarks`; see pyproject.toml), so one
import name goes into site-packages. The offline API reads as vLLM's:

    from pagedserve import LLM, SamplingParams

`LLM` and `AsyncEngine` load on first use: importing the torch-free bookkeeping
(`pagedserve.cache.block_pool`, `pagedserve.scheduler`) must not pull in torch.
"""

from importlib.metadata import PackageNotFoundError, version

from pagedserve.configs import SamplingParams

try:
    __version__ = version("pagedserve")
except PackageNotFoundError:  # a bare checkout on sys.path, not installed
    __version__ = "0+unknown"

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from pagedserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
