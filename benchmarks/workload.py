"""The shared, seeded benchmark workload and the helpers every benchmark uses to report.

Prompts are windows of real English text tokenized offline: the docstrings of a fixed list of
Python standard-library modules plus the Zen of Python (`this`). Nothing is downloaded, and the
same seed gives the same prompts (token ids) with the same Python version and tokenizer.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import inspect
import io
import json
import os
import platform
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
# Modules whose docstrings make the corpus: prose-heavy, present in every CPython install.
CORPUS_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Shape of the workload: prompt lengths uniform in [min, max], a fixed number of outputs."""

    num_requests: int = 64
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 512
    output_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(
                f"need 1 <= min_prompt_tokens <= max_prompt_tokens, got "
                f"{self.min_prompt_tokens}, {self.max_prompt_tokens}"
            )
        if self.num_requests < 1 or self.output_tokens < 1:
            raise ValueError("num_requests and output_tokens must be >= 1")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    defaults = WorkloadConfig()
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=defaults.num_requests)
    group.add_argument("--min-prompt-tokens", type=int, default=defaults.min_prompt_tokens)
    group.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    group.add_argument(
        "--output-tokens",
        type=int,
        default=defaults.output_tokens,
        help="exact output tokens per request (EOS ignored)",
    )
    group.add_argument("--seed", type=int, default=defaults.seed)


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        args.num_requests,
        args.min_prompt_tokens,
        args.max_prompt_tokens,
        args.output_tokens,
        args.seed,
    )


def prompt_lengths(config: WorkloadConfig) -> list[int]:
    """The seeded prompt length of each request (no tokenizer needed)."""
    rng = random.Random(config.seed)
    return [
        rng.randint(config.min_prompt_tokens, config.max_prompt_tokens)
        for _ in range(config.num_requests)
    ]


def corpus_text() -> str:
    """Real prose from the standard library: module, class and function docstrings."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    pieces = [codecs.decode(this.s, "rot13")]
    with warnings.catch_warnings():  # reading deprecated members (typing.io) warns
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in CORPUS_MODULES:
            module = importlib.import_module(module_name)
            members = sorted(vars(module).items())
            docs = [inspect.getdoc(module)] + [
                inspect.getdoc(value)
                for name, value in members
                if not name.startswith("_") and callable(value)
            ]
            pieces.extend(doc for doc in docs if doc)
    return "\n\n".join(dict.fromkeys(pieces))  # inherited docstrings repeat: keep each once


def build_prompts(config: WorkloadConfig, tokenizer: Any) -> list[list[int]]:
    """Token-id prompts: for each seeded length, a seeded window of the tokenized corpus."""
    corpus_ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    if len(corpus_ids) < config.max_prompt_tokens:
        raise ValueError(f"the corpus has {len(corpus_ids)} tokens, fewer than a prompt needs")
    rng = random.Random(config.seed + 1)
    prompts = []
    for length in prompt_lengths(config):
        start = rng.randrange(len(corpus_ids) - length + 1)
        prompts.append(corpus_ids[start : start + length])
    return prompts


def load_tokenizer(model: str) -> Any:
    """The engine's tokenizer for `model`, offline (the default model is converted on first use)."""
    from transformers import AutoTokenizer

    from pagedserve.engine.model_loader import resolve_model_path

    path, _ = resolve_model_path(model)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def set_num_threads(num_threads: int | None) -> None:
    """Pin torch's intra-op threads (None keeps torch's default). One value for every system
    in a run, so ratios stay fair; 1 is steadier on a machine shared with other jobs."""
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)


def last_level_cache_bytes() -> int:
    """The size of the host's largest CPU cache (Linux sysfs, cpu0), 0 where unknown. Some VMs
    report hundreds of MiB (480 MiB on a 2-vCPU Sapphire Rapids here), and there a buffer of a
    few hundred MB is read from that cache, not from memory."""
    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def read_bandwidth(num_bytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second that torch's threads stream out of memory: an int32 max over a buffer.

    The roofline for a decode step's attention, which must read every context token's K and V
    once: a reduction that does nothing else with the bytes. int32, because a float reduction
    of arbitrary bytes could meet subnormals (slow on x86), and a max, because torch's integer
    sum is not vectorised (10x slower than the memory). The buffer (default: 256 MiB, or twice the
    last-level cache where that is larger) is larger than any cache; the figure is the median of
    `repeats` passes with the current torch thread count.
    """
    import torch

    if num_bytes is None:
        num_bytes = max(256 << 20, 2 * last_level_cache_bytes())
    buffer = torch.ones(num_bytes // 4, dtype=torch.int32)  # written, so its pages are real
    buffer.amax()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.amax()
        seconds.append(time.perf_counter() - start)
    return num_bytes / sorted(seconds)[len(seconds) // 2]


def machine_info() -> dict[str, Any]:
    """Where and with what a result was measured."""
    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu_model = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in cpuinfo
                    if line.startswith("model name")
                ),
                cpu_model,
            )
    except OSError:
        pass
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],
    }
    for package in ("torch", "transformers"):
        try:
            info[package] = importlib.import_module(package).__version__
        except ImportError:
            info[package] = None
    return info


def write_results(path: Path, args: argparse.Namespace, results: Any) -> None:
    """JSON with the arguments, the machine, and the results."""
    config = {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
    }
    payload = {"config": config, "machine": machine_info(), "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}")


def _jsonable(value: Any) -> Any:
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)


def percentile(values: list[float], fraction: float) -> float:
    """Linear-interpolated percentile of `values` (NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def time_interleaved(
    candidates: dict[str, Callable[[], object]], repeats: int, device: Any = None
) -> dict[str, tuple[list[float], list[float]]]:
    """Run each candidate once per round (after a warm-up round), so noise hits them alike, in an
    order shuffled every round (seeded): what ran just before a call changes its time. In a fixed
    order, two builds of the same kernel source timed one after the other came out 3-8% apart,
    whichever ran second ahead (64 x 1,024 decode step, 2-core Zen 4); shuffled, 0.3-1%.

    Returns per candidate (wall seconds, process CPU seconds) per call. CPU time, summed over
    threads, is the steadier number on a shared machine where wall time includes waiting. On CUDA
    the wall time spans a synchronize before and after the call: the kernels' whole run.
    """

    def synchronize() -> None:
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    for run in candidates.values():
        run()
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in candidates}
    order = random.Random(0)
    for _ in range(repeats):
        for name in order.sample(list(candidates), len(candidates)):
            run = candidates[name]
            synchronize()
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            run()
            synchronize()
            times[name][0].append(time.perf_counter() - wall_start)
            times[name][1].append(time.process_time() - cpu_start)
    return times
