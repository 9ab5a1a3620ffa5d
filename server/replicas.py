"""`pagedserve replicas`: N `pagedserve serve` processes on loopback ports, each pinned to an equal
share of this machine's cores, behind sglang-router on one public port; all stop together.

The router is an existing, maintained part (PyPI `sglang-router`, Rust): cache-aware routing on
a radix tree of recent prompts per worker, round-robin, power-of-two on `/get_load`, health checks,
retries and circuit breakers. This module only launches and supervises processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
STARTUP_TIMEOUT_S = 600.0  # a first start may convert the model and build the kernel
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


class ReplicasError(RuntimeError):
    """A replica or the router could not start (the message says which, with its log tail)."""


@dataclass
class Child:
    """One supervised process: a replica (with its cores) or the router."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    cores: tuple[int, ...] = ()
    log_path: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def log_tail(self, num_chars: int = 3000) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path, errors="replace") as log:
            return log.read()[-num_chars:]


def split_cores(cores: Sequence[int], num_replicas: int) -> list[tuple[int, ...]]:
    """Equal, disjoint, contiguous shares; leftover cores go to the first replicas. With more
    replicas than cores, replicas share cores round-robin (one each)."""
    if num_replicas < 1:
        raise ValueError(f"the number of replicas must be >= 1, got {num_replicas}")
    ordered = sorted(cores)
    if num_replicas >= len(ordered):
        return [(ordered[index % len(ordered)],) for index in range(num_replicas)]
    base, extra = divmod(len(ordered), num_replicas)
    shares, start = [], 0
    for index in range(num_replicas):
        size = base + (1 if index < extra else 0)
        shares.append(tuple(ordered[start : start + size]))
        start += size
    return shares


# Ports this process handed out or was told to use. Until a child binds its port, the OS may
# offer that port again: a replica was once given the router's public port while it loaded, and
# the router then failed with "Address already in use".
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out before."""
    while True:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _child_setup(cores: tuple[int, ...]) -> None:
    """Runs in the child before exec: pin it, and have Linux end it if the launcher dies."""
    if cores:
        os.sched_setaffinity(0, cores)
    # Not Linux: no such call, and Ctrl-C / SIGTERM to the launcher still stop everything.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(
    command: list[str], env: dict[str, str], cores: tuple[int, ...], log_path: str
) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        # Own session: a Ctrl-C reaches the launcher only, which stops the router first.
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(cores),
        )


def start_replica(
    index: int, cores: tuple[int, ...], serve_args: Sequence[str], log_dir: str
) -> Child:
    port = free_port()
    env = dict(os.environ)
    # One intra-op thread per pinned core: more threads than cores only contend.
    env["OMP_NUM_THREADS"] = str(len(cores))
    command = [sys.executable, "-m", "pagedserve.server", "serve"]
    command += [*serve_args, "--host", "127.0.0.1", "--port", str(port)]
    log_path = os.path.join(log_dir, f"replica-{index}.log")
    process = _spawn(command, env, cores, log_path)
    return Child(f"replica {index}", f"http://127.0.0.1:{port}", process, cores, log_path)


def router_command(
    worker_urls: Sequence[str], host: str, port: int, policy: str, extra_args: Sequence[str] = ()
) -> list[str]:
    """sglang-router's command line. A health check every 2 s takes a dead replica out after one
    failure (its default: 60 s, 3 failures), and retries with backoff (about 4 s in all) carry the
    requests sent to it meanwhile over to a live one. Its circuit breaker is off: version 0.3.2
    counts a worker's 4xx answers (a client's bad request) as failures and would shut a healthy
    replica out for a minute (sglang issue #25811)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *worker_urls,
        "--health-check-interval-secs",
        "2",
        "--health-failure-threshold",
        "1",
        "--disable-circuit-breaker",
        "--retry-max-retries",
        "8",
        "--retry-initial-backoff-ms",
        "100",
        "--retry-max-backoff-ms",
        "1000",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        *extra_args,
    ]


def start_router(
    worker_urls: Sequence[str],
    host: str,
    port: int,
    policy: str,
    log_dir: str,
    api_key: str | None = None,
) -> Child:
    if importlib.util.find_spec("sglang_router") is None:
        raise ReplicasError(
            "sglang-router is not installed: pip install 'pagedserve[router]' (or sglang-router)"
        )
    log_path = os.path.join(log_dir, "router.log")
    # With the replicas' key the router can read /server_info (else the model shows as
    # "unknown"); clients still send their own Authorization header, which it passes on.
    command = router_command(
        worker_urls, host, port, policy, ["--api-key", api_key] if api_key else []
    )
    process = _spawn(command, dict(os.environ), (), log_path)
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return Child("router", f"http://{shown_host}:{port}", process, (), log_path, {"policy": policy})


def wait_until_ready(child: Child, path: str, deadline: float) -> None:
    """Polls `path` until it answers 200; raises with the child's log tail if it exits first."""
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise ReplicasError(
                f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}"
            )
        try:
            if httpx.get(child.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ReplicasError(f"{child.name} was not ready within the timeout:\n{child.log_tail()}")


def stop_all(children: Sequence[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to every child (the router first, so nothing new arrives), then SIGKILL."""
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait(timeout=10)


class _StopRequested(Exception):
    """Raised by the SIGINT / SIGTERM handler to leave the supervision loop."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def describe(children: Sequence[Child]) -> str:
    lines = []
    for child in children:
        if child.cores:
            cores = ",".join(str(core) for core in child.cores)
            where = f"cores {cores}, {len(child.cores)} thread(s)"
        else:
            where = f"policy {child.extra.get('policy', '?')}"
        lines.append(f"{child.name:<11} {child.url:<24} pid {child.process.pid:<8} {where}")
    return "\n".join(lines)


def _supervise(router: Child, replicas: Sequence[Child]) -> int:
    """Returns when the router exits (1); a replica that exits is reported once, and the router
    routes around it (its health check marks it down)."""
    reported: set[str] = set()
    while router.process.poll() is None:
        for replica in replicas:
            if replica.process.poll() is not None and replica.name not in reported:
                reported.add(replica.name)
                print(f"{replica.name} exited with {replica.process.returncode}", flush=True)
        time.sleep(0.5)
    print(f"the router exited with {router.process.returncode}:\n{router.log_tail()}", flush=True)
    return 1


def run(
    num_replicas: int,
    host: str,
    port: int,
    policy: str,
    serve_args: Sequence[str],
    log_dir: str,
    api_key: str | None = None,
) -> int:
    """Starts everything, prints where each listens, and stops all on Ctrl-C / SIGTERM (0)."""
    os.makedirs(log_dir, exist_ok=True)
    _handed_out.add(port)  # the router's: no replica may be given it
    shares = split_cores(sorted(os.sched_getaffinity(0)), num_replicas)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    replicas: list[Child] = []
    router: Child | None = None
    try:
        replicas = [start_replica(i, cores, serve_args, log_dir) for i, cores in enumerate(shares)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for replica in replicas:
            wait_until_ready(replica, "/health", deadline)
        urls = [replica.url for replica in replicas]
        router = start_router(urls, host, port, policy, log_dir, api_key)
        wait_until_ready(router, "/readiness", time.monotonic() + 60)
        print(describe([*replicas, router]), f"\nlogs in {log_dir}", sep="\n", flush=True)
        return _supervise(router, replicas)
    except _StopRequested as stop:
        print(f"{stop}: stopping the router and {len(replicas)} replica(s)", flush=True)
        return 0
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the stop
        stop_all(([router] if router else []) + replicas)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
