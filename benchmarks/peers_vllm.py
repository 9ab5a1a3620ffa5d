"""vLLM's side of `benchmarks/peers.py`: run in vLLM's own venv as a script, never imported.

    ~/venv-vllm/bin/python benchmarks/peers_vllm.py --model DIR --prompts IN.json --output OUT.json
        [--dtype float32|bfloat16] [--output-tokens 128]

It reads token-id prompts from IN.json (written by peers.py, so both engines see the same
tokens), generates greedily with `ignore_eos` through vLLM's offline `LLM`, and writes token
counts and the timed seconds to OUT.json. It imports nothing from pagedserve: vLLM pins its own
transformers, so it cannot share our venv. The KV budget and thread binding come from the
environment peers.py sets (`VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_OMP_THREADS_BIND`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--dtype", default=None, help="default: vLLM's own ('auto')")
    parser.add_argument("--output-tokens", type=int, default=128)
    return parser.parse_args()


def read_cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) CPU ticks from /proc/stat, as pagedserve's benchmarks/host_quiet.py reads
    them (not imported: this script runs in vLLM's venv)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (fields[7], sum(fields)) if len(fields) == 8 else None


def main() -> None:
    args = parse_args()
    import vllm
    from vllm import LLM, SamplingParams

    prompts = json.loads(args.prompts.read_text())
    llm = LLM(model=args.model, seed=0, **({"dtype": args.dtype} if args.dtype else {}))
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    # Untimed warm-up, as pagedserve's side gets one: first-call allocations and kernel set-up.
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2))
    ticks, start = read_cpu_ticks(), time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = read_cpu_ticks()
    steal = (after[0] - ticks[0]) / max(1, after[1] - ticks[1]) if ticks and after else None
    model_config = llm.llm_engine.model_config
    result = {
        "vllm": vllm.__version__,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "seconds": seconds,
        "steal_share": steal,  # of the CPU time, taken by the hypervisor while timed
        "num_prompt_tokens": sum(map(len, prompts)),
        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }
    args.output.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
