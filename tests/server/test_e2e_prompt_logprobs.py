"""End to end, prompt logprobs from a real server (default model, float32, prefix caching on,
a step budget smaller than the longest prompt): through the `openai` client they equal
log_softmax of Hugging Face's forward pass over the same tokens (max abs error <= 1e-4), with the
longest prompt already in the prefix cache; and lm-evaluation-harness scores a small local
multiple-choice task (tests/fixtures/lm_eval) through `local-completions` against the server with
the same per-question choices and accuracy as through its `hf` model on the same weights.

lm-eval runs as a subprocess with the Hugging Face hub and datasets offline: nothing is downloaded.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from pagedserve.configs.engine import DEFAULT_MODEL
from pagedserve.engine.model_loader import resolve_model_path
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_ABS_ERROR = 1e-4
LM_EVAL_TASKS = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"
ENGINE_FLAGS = (
    "--max-model-len",
    "1100",
    "--num-kv-blocks",
    "256",
    "--block-size",
    "16",
    "--max-num-batched-tokens",
    "256",  # chunked prefill: smaller than the 1,000-token prompt
    "--enable-prefix-caching",
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(*ENGINE_FLAGS, wait=False)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model_path() -> Path:
    path, _ = resolve_model_path(DEFAULT_MODEL)
    return path


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    server.wait_until_healthy()
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)


def _hf_logprobs(model_path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.inference_mode():
        return [
            torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
            for prompt in prompts
        ]


def test_echoed_prompt_logprobs_equal_hf_for_1_to_1000_tokens_with_a_cached_prefix(
    client, model_path
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    corpus = tokenizer.encode(
        " ".join(f"Step {i}: mix, fold and bake the dough." for i in range(200))
    )
    prompts = [corpus[:1], corpus[5:21], corpus[:1000]]
    references = _hf_logprobs(model_path, prompts)
    client.completions.create(model=DEFAULT_MODEL, prompt=prompts[2], max_tokens=1)  # caches it
    response = client.completions.create(
        model=DEFAULT_MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1
    )
    assert response.usage.prompt_tokens == 1017 and response.usage.completion_tokens == 0
    for choice, prompt, reference in zip(response.choices, prompts, references, strict=True):
        logprobs = choice.logprobs
        assert choice.finish_reason == "length" and choice.text == tokenizer.decode(prompt)
        assert len(logprobs.tokens) == len(prompt) and logprobs.token_logprobs[0] is None
        wanted = [float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        errors = [abs(a - b) for a, b in zip(logprobs.token_logprobs[1:], wanted, strict=True)]
        assert max(errors, default=0.0) <= MAX_ABS_ERROR
        assert logprobs.text_offset[0] == 0


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(client):
    chunks = list(
        client.completions.create(
            model=DEFAULT_MODEL,
            prompt="One, two, three,",
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=0,
            stream=True,
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith("One, two, three,")
    assert first.logprobs.tokens[:2] == ["One", ","] and first.logprobs.token_logprobs[0] is None


def _lm_eval(model: str, model_args: str, output_path: Path) -> list[dict]:
    """Run lm-eval offline on the local task; its per-question samples."""
    environ = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(output_path / "datasets"),
        OMP_NUM_THREADS="1",
    )
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model]
    command += ["--model_args", model_args, "--tasks", "pagedserve_mc", "--batch_size", "1"]
    command += ["--include_path", ".", "--output_path", str(output_path), "--log_samples"]
    if model == "hf":
        command += ["--device", "cpu"]
    done = subprocess.run(
        command, cwd=LM_EVAL_TASKS, env=environ, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (samples,) = glob.glob(f"{output_path}/*/samples_pagedserve_mc_*.jsonl")
    return sorted((json.loads(line) for line in open(samples)), key=lambda s: s["doc_id"])


def _choice_logliks(sample: dict) -> list[float]:
    return [float(response[0]) for response in sample["filtered_resps"]]


def test_lm_eval_local_completions_scores_as_its_hf_model_does(
    server, client, model_path, tmp_path
):
    served = _lm_eval(
        "local-completions",
        f"base_url={server.url}/v1/completions,model={DEFAULT_MODEL},tokenizer={model_path},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
        tmp_path / "served",
    )
    hf = _lm_eval("hf", f"pretrained={model_path},dtype=float32", tmp_path / "hf")
    assert len(served) == len(hf) == 16
    for ours, theirs in zip(served, hf, strict=True):
        ours_ll, theirs_ll = _choice_logliks(ours), _choice_logliks(theirs)
        assert ours_ll.index(max(ours_ll)) == theirs_ll.index(max(theirs_ll)), ours["doc"]
        assert ours["acc"] == theirs["acc"]
        assert max(abs(a - b) for a, b in zip(ours_ll, theirs_ll, strict=True)) < 1e-3
    accuracy = sum(sample["acc"] for sample in served) / len(served)
    assert accuracy == sum(sample["acc"] for sample in hf) / len(hf)
    assert accuracy > 0.5  # the model knows some of these: the scores are not noise
