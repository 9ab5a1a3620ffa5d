"""End to end: `pagedserve run-batch` with the real default model answers a file of chat,
completion and SGLang requests as the offline `LLM` does (greedy, token for token), with a
refused line's error in its place, in input order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server_process import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE_FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", "16")
ENGINE_FLAGS += ("--dtype", "float32")  # as the offline reference
PROMPTS = ("The capital of France is", "def fibonacci(n):")
CHAT = [{"role": "user", "content": "Name three colors."}]
NUM_TOKENS = 12


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch_answers_as_the_offline_llm_does(tmp_path):
    greedy = {"max_tokens": NUM_TOKENS, "temperature": 0}
    lines = [
        *(
            _line(f"p{i}", "/v1/completions", {"prompt": p, **greedy})
            for i, p in enumerate(PROMPTS)
        ),
        _line("chat", "/v1/chat/completions", {"messages": CHAT, **greedy}),
        _line("refused", "/v1/completions", {"prompt": "x", "max_tokens": 100_000}),
        _line(
            "sglang",
            "/generate",
            {
                "text": PROMPTS[0],
                "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0},
            },
        ),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    environ.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-m", "pagedserve.server", "run-batch", "-i", str(source)]
    finished = subprocess.run(
        [*command, "-o", str(target), *ENGINE_FLAGS],
        env=environ,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "run-batch: 5/5 requests done (100%" in finished.stderr
    answers = {answer["custom_id"]: answer for answer in map(json.loads, target.open())}
    assert list(answers) == ["p0", "p1", "chat", "refused", "sglang"]

    from pagedserve.configs import SamplingParams
    from pagedserve.engine.llm import LLM

    llm = LLM(max_model_len=1024, num_kv_blocks=256, block_size=16, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    offline = llm.generate(list(PROMPTS), params)
    (chat,) = llm.chat([CHAT], params)
    for index, output in enumerate(offline):
        body = answers[f"p{index}"]["response"]["body"]
        assert body["choices"][0]["text"] == output.outputs[0].text
    assert answers["sglang"]["response"]["body"]["text"] == offline[0].outputs[0].text
    body = answers["chat"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == chat.outputs[0].text
    refused = answers["refused"]
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] is None
    assert refused["error"]["error"]["param"] == "max_tokens"
