"""Speculative decoding (n-gram prompt lookup): a copy-heavy workload at batch 1 and 4 with and
without speculation in one run (tokens/s, speedup, acceptance, greedy output identical), and the
fixed throughput workload at batch 64 with speculation enabled (its batch-size gate must keep it
from getting slower).

    python -m pagedserve.benchmarks.spec_decode [--batches 1 4] [--num-prompts 4]
        [--output-tokens 256] [--num-speculative-tokens 4] [--skip-throughput] [--num-threads 1]

Copy-heavy prompts ask the default chat model to rewrite ~500 tokens of standard-library source
code with one change (rename one identifier): the answer quotes most of the prompt, which is
where prompt lookup drafts well. Greedy; EOS ends a request (both runs emit identical tokens).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    WorkloadConfig,
    build_prompts,
    load_tokenizer,
    set_num_threads,
    write_results,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Functions and classes of plain, readable standard-library code (present in every CPython).
SOURCES = (
    "textwrap.TextWrapper._wrap_chunks",
    "heapq.merge",
    "json.encoder.py_encode_basestring_ascii",
    "shutil.copyfileobj",
    "statistics.median_grouped",
    "functools.lru_cache",
    "string.capwords",
    "csv.Sniffer._guess_quote_and_delimiter",
)
RENAMES = (("result", "output"), ("line", "row"), ("i", "index"), ("data", "payload"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per batch size")
    parser.add_argument("--prompt-tokens", type=int, default=500, help="code tokens per prompt")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=4)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--throughput-requests", type=int, default=64)
    parser.add_argument("--throughput-output-tokens", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "spec_decode.json")
    return parser.parse_args(argv)


def _source(dotted: str) -> str:
    import importlib

    module_name, _, attr = dotted.rpartition(".")
    try:
        obj = importlib.import_module(module_name)
    except ImportError:  # a class path: textwrap.TextWrapper._wrap_chunks
        module_name, _, cls = module_name.rpartition(".")
        obj = getattr(importlib.import_module(module_name), cls)
    return inspect.getsource(getattr(obj, attr))


def _code_window(tokenizer: Any, first: int, num_code_tokens: int) -> str:
    """Whole lines of the sources from SOURCES[first] on, up to ~num_code_tokens tokens."""
    lines: list[str] = []
    num_tokens = 0
    for offset in range(len(SOURCES)):
        for line in _source(SOURCES[(first + offset) % len(SOURCES)]).splitlines() + [""]:
            num_tokens += len(tokenizer.encode(line + "\n", add_special_tokens=False))
            if num_tokens > num_code_tokens:
                return "\n".join(lines)
            lines.append(line)
    return "\n".join(lines)


def copy_heavy_prompts(tokenizer: Any, num_prompts: int, num_code_tokens: int, seed: int):
    """Chat prompts: 'rewrite this code with one change', each ~num_code_tokens of code."""
    rng = random.Random(seed)
    prompts = []
    for index in range(num_prompts):
        code = _code_window(tokenizer, index, num_code_tokens)
        old, new = rng.choice(RENAMES)
        message = (
            f"Rewrite this Python code with one change: rename `{old}` to `{new}`. "
            f"Output only the full rewritten code.\n\n```python\n{code}\n```"
        )
        prompts.append(
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": message}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        )
    return prompts


def make_llm(args: argparse.Namespace, speculative: bool, **settings: Any):
    from pagedserve.engine.llm import LLM

    if speculative:
        settings["speculative_config"] = json.dumps(
            {
                "method": "ngram",
                "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": args.prompt_lookup_max,
                "disable_by_batch_size": args.disable_by_batch_size,
            }
        )
    return LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory="1GiB",
        enable_prefix_caching=False,  # repeated runs must not get cheaper prefills
        **settings,
    )


def timed_run(llm: Any, batches: list[list[list[int]]], params: Any) -> dict[str, Any]:
    """Each batch submitted together, batches one after another; tokens, seconds, spec counters."""
    llm.generate([batches[0][0][:8]], type(params)(temperature=0, max_tokens=2))  # warm-up
    before = llm.engine.stats()
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for batch in batches:
        outputs.extend(o.outputs[0].token_ids for o in llm.generate(batch, params))
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    num_tokens = sum(map(len, outputs))
    return {
        "outputs": outputs,
        "num_output_tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_steps": after.spec_num_drafts - before.spec_num_drafts,
    }


def compare(args: argparse.Namespace, label: str, batches: list, params: Any, **settings: Any):
    runs = {}
    for speculative in (False, True):
        llm = make_llm(args, speculative, **settings)
        runs[speculative] = timed_run(llm, batches, params)
        del llm
    off, on = runs[False], runs[True]
    row = {
        "workload": label,
        "tokens": on["num_output_tokens"],
        "off_tok_s": off["tokens_per_s"],
        "on_tok_s": on["tokens_per_s"],
        "speedup": on["tokens_per_s"] / off["tokens_per_s"],
        "acceptance_rate": on["acceptance_rate"],
        "accepted_per_draft_step": (
            on["accepted_tokens"] / on["draft_steps"] if on["draft_steps"] else None
        ),
        "identical_output": on["outputs"] == off["outputs"],
    }
    rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
    print(
        f"| {label} | {row['tokens']} | {row['off_tok_s']:.1f} | {row['on_tok_s']:.1f} | "
        f"{row['speedup']:.2f}x | {rate} | {row['identical_output']} |",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from pagedserve.configs import SamplingParams

    args = parse_args(argv)
    set_num_threads(args.num_threads)
    tokenizer = load_tokenizer(args.model)
    print("| workload | out tok | off tok/s | on tok/s | speedup | acceptance | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens)
    for batch_size in args.batches:
        prompts = copy_heavy_prompts(
            tokenizer, max(args.num_prompts, batch_size), args.prompt_tokens, args.seed
        )
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        rows.append(compare(args, f"copy-heavy, batch {batch_size}", batches, params))
    if not args.skip_throughput:
        workload = WorkloadConfig(
            num_requests=args.throughput_requests,
            output_tokens=args.throughput_output_tokens,
            seed=args.seed,
        )
        fixed = build_prompts(workload, tokenizer)
        fixed_params = SamplingParams(
            temperature=0, max_tokens=workload.output_tokens, ignore_eos=True
        )
        rows.append(
            compare(
                args,
                f"throughput workload, batch {workload.num_requests}",
                [fixed],
                fixed_params,
                max_num_seqs=workload.num_requests,
            )
        )
    write_results(args.output, args, rows)
    return rows


if __name__ == "__main__":
    main()
