"""A real Prometheus scrapes a real pagedserve server, with the config shipped in configs/prometheus.yml.

Needs the `prometheus` binary (`.ci/install-prometheus.sh` installs Debian's package). Starts
`pagedserve serve` with the default model on a free local port, sends one completion, then asks
Prometheus's HTTP API for the generated-token counter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.server_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"
QUERY = "pagedserve:generation_tokens_total"

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is missing: run .ci/install-prometheus.sh (Debian's package)",
    ),
]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _wait_for(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"{process.args[0]} exited with {process.returncode}:\n{log.read_text()[-4000:]}"
            )
        try:
            _get(url, timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"{url} not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _server_command(port: int) -> list[str]:
    # The venv's console script when the project is installed; the module otherwise.
    script = Path(sys.executable).parent / "pagedserve"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "pagedserve.server"]
    return [*launcher, "serve", "--host", "127.0.0.1", "--port", str(port)]


@pytest.fixture(scope="module")
def server_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A pagedserve server with small settings on a free port; its log is shown if it fails."""
    port = free_port()
    log = tmp_path_factory.mktemp("pagedserve") / "server.log"
    small = {
        "PAGEDSERVE_KV_CACHE_MEMORY": "64MiB",
        "PAGEDSERVE_MAX_NUM_SEQS": "4",
        "PAGEDSERVE_MAX_MODEL_LEN": "512",
        "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS": "128",
    }
    with log.open("wb") as output:
        process = subprocess.Popen(
            _server_command(port),
            cwd=REPO_ROOT,
            env={**os.environ, **small},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        # The first start on a machine converts the default model (about 20 s on 2 cores).
        _wait_for(f"http://127.0.0.1:{port}/health", process, log, timeout_s=300)
        yield port
    finally:
        _stop(process)


def _prometheus_config(path: Path, target: str) -> None:
    """configs/prometheus.yml with its pagedserve target pointed at `target`."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "pagedserve"]
    job["static_configs"] = [{"targets": [target]}]
    path.write_text(yaml.safe_dump(config))


@pytest.fixture
def prometheus_url(tmp_path: Path, server_port: int) -> Iterator[str]:
    config, port, log = tmp_path / "prometheus.yml", free_port(), tmp_path / "prometheus.log"
    _prometheus_config(config, f"127.0.0.1:{server_port}")
    command = [
        str(PROMETHEUS),
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        _wait_for(f"http://127.0.0.1:{port}/-/ready", process, log, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(process)


def _complete(port: int) -> dict:
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_prometheus_scrapes_generated_tokens_after_a_completion(
    server_port: int, prometheus_url: str
):
    completion = _complete(server_port)
    generated = completion["usage"]["completion_tokens"]
    assert generated > 0
    url = f"{prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': QUERY})}"
    deadline, result = time.monotonic() + 60, []
    # The next scrape after the reply lands within one scrape interval; one taken while the
    # request was still generating holds fewer tokens, so wait for a scrape with them all.
    while time.monotonic() < deadline:
        answer = json.loads(_get(url))
        assert answer["status"] == "success", answer
        result = answer["data"]["result"]
        if result and float(result[0]["value"][1]) >= generated:
            break
        time.sleep(1)
    assert result, (
        f"Prometheus has no samples of {QUERY}; targets: {_get(prometheus_url + '/api/v1/targets')!r}"
    )
    (sample,) = result
    assert float(sample["value"][1]) >= generated
    assert sample["metric"]["model_name"] == MODEL_NAME
    assert sample["metric"]["job"] == "pagedserve"
