"""Polls `GET {url}/health` from a process of its own and prints the latencies as a JSON list.

`python -m tests.health_prober URL [interval_s]` prints `ready` once its first poll answered, then
polls every `interval_s` until its stdin closes, then prints the latencies (seconds) on one line.

Why a process: a prober on the test's own event loop measures the test as much as the server.
That loop also parses 64 SSE streams, and by the end of a full suite the test process holds a
large heap, so a garbage collection there pauses the probe too: CI once saw one 1.04 s poll among
76 where runs of this test alone never exceed 0.11 s. A fresh process with only this loop
measures what a load balancer's health check would see.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main() -> None:
    url = sys.argv[1]
    interval_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    latencies: list[float] = []
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            started = time.monotonic()
            response = client.get(f"{url}/health")
            latencies.append(time.monotonic() - started)
            if response.status_code != 200:
                raise SystemExit(f"/health answered {response.status_code}: {response.text}")
            if len(latencies) == 1:
                print("ready", flush=True)
            stop.wait(interval_s)
    print(json.dumps(latencies), flush=True)


if __name__ == "__main__":
    main()
