"""A real `pagedserve replicas` launcher in a subprocess (N servers with the default model behind
sglang-router), the addresses it prints, and helpers that read each replica's /metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import REPO_ROOT, free_port

STARTUP_TIMEOUT_S = 400.0
_LINE = re.compile(r"^(replica \d+|router)\s+(http://\S+)\s+pid (\d+)")


@dataclass
class Launched:
    name: str
    url: str
    pid: int


@dataclass
class Replicas:
    """`Replicas(2, policy="cache_aware")` starts the launcher and waits for its address table."""

    num_replicas: int
    policy: str = "cache_aware"
    serve_args: tuple[str, ...] = ()
    router: Launched | None = None
    replicas: list[Launched] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.log_dir = tempfile.mkdtemp(prefix="pagedserve-replicas-test-")
        self.output: list[str] = []
        command = [sys.executable, "-m", "pagedserve.server", "replicas"]
        command += ["-n", str(self.num_replicas), "--port", str(self.port)]
        command += ["--policy", self.policy, "--log-dir", self.log_dir, "--log-level", "warning"]
        command += list(self.serve_args)
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ),
        )
        self._ready = threading.Event()
        threading.Thread(target=self._read_output, daemon=True).start()
        if not self._ready.wait(STARTUP_TIMEOUT_S) or self.router is None:
            self.stop()
            raise RuntimeError(f"the launcher did not come up:\n{self.describe_failure()}")

    def _read_output(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            match = _LINE.match(line)
            if match:
                launched = Launched(match[1], match[2], int(match[3]))
                if launched.name == "router":
                    self.router = launched
                else:
                    self.replicas.append(launched)
            if line.startswith("logs in "):
                self._ready.set()
        self._ready.set()  # the launcher exited

    def describe_failure(self) -> str:
        logs = "".join(
            f"\n--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
            for path in sorted(Path(self.log_dir).glob("*.log"))
        )
        return "".join(self.output) + logs

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        """SIGTERM to the launcher (it stops the router and the replicas), then SIGKILL."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode


def scrape(url: str) -> dict[str, float]:
    """Metric sample name -> value, summed over labels (e.g. every finish reason)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def num_finished(url: str) -> float:
    return scrape(url)["pagedserve:request_success_total"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
