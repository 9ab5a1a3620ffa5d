"""A real `pagedserve serve` subprocess on a free 127.0.0.1 port, shared by every test module
that talks to a running server (end-to-end, reliability, Prometheus).

Output goes to a log file whose tail is shown when startup fails. One intra-op thread unless the
caller sets OMP_NUM_THREADS: the tests run a client (sometimes a model too) beside the server on
a small machine, where two OpenMP threads per process make the server many times slower.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """Starts the server with `args` (flags after `serve`); `wait=False` returns at once so the
    caller can overlap other set-up with the model load, then call `wait_until_healthy()`."""

    def __init__(
        self,
        *args: str,
        wait: bool = True,
        drop_env: tuple[str, ...] = (),
        log_level: str = "warning",
        ca_file: str | None = None,
    ) -> None:
        self.port = free_port()
        # With --ssl-* flags: HTTPS, its certificate checked against `ca_file`.
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file else True
        )
        self.url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        log_fd, self.log_path = tempfile.mkstemp(prefix="pagedserve-test-", suffix=".log")
        environ = {name: value for name, value in os.environ.items() if name not in drop_env}
        environ["PYTHONPATH"] = str(REPO_ROOT)
        environ.setdefault("OMP_NUM_THREADS", "1")
        command = [
            sys.executable,
            "-m",
            "pagedserve.server",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            log_level,
            # The tests' references (HF, the offline LLM) are float32; `auto` would be bfloat16
            # on a CPU with AMX or AVX512_BF16, so a test says --dtype itself to get another.
            *(() if "--dtype" in args else ("--dtype", "float32")),
            *args,
        ]
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log_fd, stderr=subprocess.STDOUT, env=environ
        )
        os.close(log_fd)  # the child has its own copy
        if wait:
            self.wait_until_healthy()

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, num_chars: int = 4000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-num_chars:]

    def wait_until_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                health = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"the server did not become healthy (exit code {self.process.poll()}):"
            f"\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL after 30 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
