"""End to end: HTTPS (`--ssl-keyfile`, `--ssl-certfile`) and a proxy's path prefix (`--root-path`)
on a real server, with a self-signed certificate made by `openssl` for 127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
API_KEY = "test-key"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return key, cert


@pytest.fixture(scope="module")
def server(certificate) -> Iterator[ServerProcess]:
    key, cert = certificate
    process = ServerProcess(
        *("--max-model-len", "512", "--num-kv-blocks", "64", "--api-key", API_KEY),
        *("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/llm"),
        ca_file=str(cert),
    )
    yield process
    process.stop()


def test_completions_are_served_over_https(server):
    client = openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        http_client=httpx.Client(verify=server.verify),
        max_retries=0,
    )
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    with pytest.raises(httpx.TransportError):  # the server speaks TLS only
        httpx.get(f"{server.url.replace('https', 'http')}/health", timeout=5)


def test_behind_a_path_prefix_the_routes_probes_and_dashboard_still_work(server):
    def get(path: str, **headers: str) -> httpx.Response:
        return httpx.get(f"{server.url}{path}", headers=headers, verify=server.verify, timeout=30)

    # The proxy strips /llm; the server knows it is there (uvicorn puts it back in the path).
    assert get("/health").status_code == 200  # probes need no key under a prefix too
    assert get("/v1/models").status_code == 401
    assert get("/v1/models", authorization=f"Bearer {API_KEY}").status_code == 200
    assert (
        get("/dashboard").status_code == 200 and get("/dashboard/dashboard.js").status_code == 200
    )
    assert "'/llm/openapi.json'" in get("/docs", authorization=f"Bearer {API_KEY}").text
