"""Build the image with podman, run it, and check it serves, is healthy, is not root, and stops fast.

Opt-in (`--run-docker`, as `make docker-smoke` passes) because a cold build takes minutes. Where
no registry is reachable, `podman_base_images.sh` makes the base images locally. pip reads wheels
from a build-time volume: `DOCKER_SMOKE_WHEELS` (not a `PAGEDSERVE_*` name, which would be read as
a setting), else pip's `PIP_FIND_LINKS` folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
IMAGE = "localhost/pagedserve:smoke"
CONTAINER = "pagedserve-smoke"
# crun cannot run on these hosts (hybrid cgroups) and podman's default rlimits exceed the hard ones.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

# A cold run (base images, pip downloads, model conversion, kernel build) is ~10 min on 2 cores.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]


def _podman(
    env: dict[str, str], *args: str, timeout: float = 60, check: bool = True
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["podman", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def _wheels_dir() -> Path | None:
    for candidate in (os.environ.get("DOCKER_SMOKE_WHEELS"), os.environ.get("PIP_FIND_LINKS")):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("podman") is None:
        pytest.skip(
            "podman is not installed (Debian: apt-get install podman buildah runc debootstrap catatonit;"
            " catatonit is what `podman run --init` starts)"
        )
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    started = time.monotonic()
    subprocess.run([str(HERE / "podman_base_images.sh")], env=env, check=True, timeout=1200)
    print(f"base images ready in {time.monotonic() - started:.0f} s")
    return env


@pytest.fixture(scope="module")
def image(podman_env: dict[str, str]) -> str:
    command = [
        "build",
        "--format",
        "docker",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "-t",
        IMAGE,
    ]
    wheels = _wheels_dir()
    if wheels is not None:
        command += ["-v", f"{wheels}:/wheels:ro"]
        if any(wheels.glob("torch-*.whl")):
            command += ["--build-arg", "TORCH_INDEX_URL="]  # the local torch wheel is the CPU build
    started = time.monotonic()
    _podman(podman_env, *command, str(REPO_ROOT), timeout=1800)
    size = int(_podman(podman_env, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"image built in {time.monotonic() - started:.0f} s, size {size / 2**30:.2f} GiB")
    return IMAGE


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _logs(env: dict[str, str]) -> str:
    result = _podman(env, "logs", CONTAINER, check=False)
    return (result.stdout + result.stderr)[-4000:]


def _wait_healthy(env: dict[str, str], timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if _podman(env, "healthcheck", "run", CONTAINER, check=False).returncode == 0:
            return time.monotonic() - started
        state = _podman(env, "inspect", "--format", "{{.State.Status}}", CONTAINER).stdout.strip()
        if state != "running":
            pytest.fail(f"container is {state}:\n{_logs(env)}")
        time.sleep(1)
    pytest.fail(f"not healthy after {timeout_s} s:\n{_logs(env)}")


def _complete(port: int) -> dict:
    body = json.dumps(
        {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 8}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_image_serves_as_non_root_and_stops_within_20_s(podman_env: dict[str, str], image: str):
    port = _free_port()
    _podman(podman_env, "rm", "-f", CONTAINER, check=False)
    started = time.monotonic()
    # --init: a tiny init forwards SIGTERM to the server; host network, so the port must be free.
    _podman(
        podman_env,
        "run",
        "-d",
        "--init",
        "--name",
        CONTAINER,
        "--network",
        "host",
        "-e",
        f"PAGEDSERVE_PORT={port}",
        "-e",
        "PAGEDSERVE_KV_CACHE_MEMORY=128MiB",
        image,
    )
    try:
        seconds_to_healthy = _wait_healthy(podman_env, timeout_s=300)
        print(
            f"healthy {seconds_to_healthy:.1f} s after podman run ({time.monotonic() - started:.1f} s in all)"
        )
        completion = _complete(port)
        assert completion["choices"][0]["text"]
        assert completion["usage"]["completion_tokens"] > 0
        assert _podman(podman_env, "exec", CONTAINER, "id", "-u").stdout.strip() != "0"
        stop_started = time.monotonic()
        _podman(podman_env, "stop", "-t", "20", CONTAINER, timeout=60)
        seconds_to_stop = time.monotonic() - stop_started
        exit_code = _podman(
            podman_env, "inspect", "--format", "{{.State.ExitCode}}", CONTAINER
        ).stdout.strip()
        print(f"stopped in {seconds_to_stop:.1f} s with exit code {exit_code}")
        assert seconds_to_stop < 20
        assert exit_code != "137", "the server ignored SIGTERM and was killed"
    finally:
        _podman(podman_env, "rm", "-f", CONTAINER, check=False)
