"""Cost of structured outputs in a decode step: at batch 16 on the default model, every request
constrained by one JSON schema, the time spent filling the grammar bitmasks and applying them to
the logits (`StructuredOutputManager.apply`, timed by the engine per step) as a share of the whole
decode step (`LLMEngine.step`). Goal: <= 10%. An unconstrained run of the same batch, in the same
process, shows what the constraint adds to the step overall.

    python -m pagedserve.benchmarks.structured [--batch-size 16] [--steps 20] [--num-threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.workload import RESULTS_DIR, set_num_threads, write_results

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Free-running strings and an unbounded array keep every row in the grammar for all timed steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "documentary"]},
        "cast": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["title", "year", "genre", "cast"],
}
PROMPT = "Describe a film as JSON with its title, year, genre and cast."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--output", default=str(RESULTS_DIR / "structured.json"), help="result JSON"
    )
    return parser.parse_args(argv)


def _run(engine: Any, args: argparse.Namespace, constrained: bool) -> dict[str, float]:
    from pagedserve.configs import SamplingParams, StructuredOutputs

    constraint = StructuredOutputs("json", json.dumps(SCHEMA)) if constrained else None
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=args.warmup_steps + args.steps + 4,
        ignore_eos=True,
        structured_outputs=constraint,
    )
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    tag = "c" if constrained else "u"
    for index in range(args.batch_size):
        engine.add_request(f"{tag}{index}", list(prompt), params)
    engine.step()  # prefill (all prompts fit one step's token budget)
    for _ in range(args.warmup_steps):
        engine.step()
    engine.structured.mask_times_s.clear()
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    mask_times = list(engine.structured.mask_times_s)
    for index in range(args.batch_size):
        engine.abort_request(f"{tag}{index}")
    step_ms = statistics.median(step_times) * 1e3
    mask_ms = statistics.median(mask_times) * 1e3 if mask_times else 0.0
    return {"step_ms": step_ms, "mask_ms": mask_ms, "mask_share": mask_ms / step_ms}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    set_num_threads(args.num_threads)
    from pagedserve.configs import load_engine_config
    from pagedserve.engine.llm_engine import LLMEngine

    config = load_engine_config(
        cli={"model": args.model, "dtype": "float32", "max_model_len": 1024}, environ={}
    )
    engine = LLMEngine(config)
    unconstrained = _run(engine, args, constrained=False)
    constrained = _run(engine, args, constrained=True)
    results = {
        "batch_size": args.batch_size,
        "unconstrained_step_ms": unconstrained["step_ms"],
        "constrained_step_ms": constrained["step_ms"],
        "mask_fill_apply_ms": constrained["mask_ms"],
        "mask_share_of_step": constrained["mask_share"],
        "goal_mask_share": 0.10,
    }
    for key, value in results.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    write_results(Path(args.output), args, results)
    return results


if __name__ == "__main__":
    main()
