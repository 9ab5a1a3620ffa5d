"""The engine state and the dashboard against a real server (`pagedserve serve`, default model).

While three streams with a shared 64-token prompt prefix are held mid-flight, the state shows the
prefix's blocks with ref count 3 and, for every block, exactly the owners whose block table holds
it; after all finish every block is free or cached-free. Then headless Chromium (Debian's package,
`.ci/install-debian-package.sh chromium chromium`; skipped without it) loads /dashboard while a load runs: the grid has one
cell per block, at least one running request row shows, and no JavaScript error is logged.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.chromium import CHROMIUM, Browser
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_KV_BLOCKS = 160
BLOCK_SIZE = 16
PREFIX = [(7 * i) % 4000 + 100 for i in range(4 * BLOCK_SIZE)]  # four full blocks
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ServerProcess(
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--block-size",
        str(BLOCK_SIZE),
    )
    yield server.url
    server.stop()


def get_state(url: str) -> dict[str, Any]:
    """The state, its columnar pool turned into one dict per block (as the page does)."""
    response = httpx.get(f"{url}/v1/engine/state", timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    state = response.json()
    columns = state["blocks"]
    assert set(columns) == {"state", "ref_count", "owner_ids", "is_hashed"}
    assert all(len(column) == state["num_blocks"] for column in columns.values())
    state["blocks"] = [
        {"block_id": block_id} | {name: column[block_id] for name, column in columns.items()}
        for block_id in range(state["num_blocks"])
    ]
    return state


def wait_for_idle(url: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = get_state(url)
        if not state["running"] and not state["waiting"] or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


class HeldStream:
    """A streaming completion read one event at a time, so the test holds it mid-flight."""

    def __init__(self, client: httpx.Client, prompt: list[int], max_tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        body["temperature"] = 0
        self._context = client.stream("POST", "/v1/completions", json=body)
        self.response = self._context.__enter__()
        assert self.response.status_code == 200
        self._lines = self.response.iter_lines()
        first = self.next_event()
        # The scheduler's sequence id: the HTTP request id, the prompt's index, the choice's.
        self.sequence_id = first["id"].removeprefix("cmpl-") + "-0#0"

    def next_event(self) -> dict[str, Any]:
        for line in self._lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                return json.loads(line[len("data: ") :])
        raise AssertionError("the stream ended early")

    def finish(self) -> None:
        for _ in self._lines:
            pass
        self._context.__exit__(None, None, None)


def assert_owners_match_tables(state: dict[str, Any]) -> None:
    tables = {r["sequence_id"]: r["block_table"] for r in state["running"] + state["waiting"]}
    assert len(state["blocks"]) == state["num_blocks"] == NUM_KV_BLOCKS
    for block in state["blocks"]:
        holders = sorted(
            sequence_id
            for sequence_id, table in tables.items()
            for b in table
            if b == block["block_id"]
        )
        assert sorted(block["owner_ids"]) == holders, block
        assert block["ref_count"] == len(holders), block
        assert block["state"] == (
            "in_use" if holders else "cached" if block["is_hashed"] else "free"
        )


def test_shared_prefix_blocks_report_their_ref_count_and_owners_then_all_are_free(url):
    assert wait_for_idle(url)["running"] == []
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        # The first computes the prefix (and registers its blocks); the others then share them.
        streams = [HeldStream(client, PREFIX + [11, 12, 13], max_tokens=200)]
        streams += [HeldStream(client, PREFIX + [20 + i], max_tokens=200) for i in range(2)]
        during = get_state(url)
        for stream in streams:
            stream.finish()
    after = wait_for_idle(url)

    assert_owners_match_tables(during)
    running = {r["sequence_id"]: r for r in during["running"]}
    ids = [stream.sequence_id for stream in streams]
    assert set(ids) <= set(running), (ids, list(running))
    prefix_blocks = running[ids[0]]["block_table"][:4]
    for sequence_id in ids[1:]:
        assert running[sequence_id]["block_table"][:4] == prefix_blocks
        assert running[sequence_id]["num_cached_tokens"] == 4 * BLOCK_SIZE
    for block_id in prefix_blocks:
        block = during["blocks"][block_id]
        assert block["ref_count"] == 3 and block["is_hashed"], block
        assert sorted(block["owner_ids"]) == sorted(ids)
    assert during["last_plan"]["num_batched_tokens"] >= 1
    assert during["num_steps"] > 0

    assert after["running"] == after["waiting"] == []
    assert {block["state"] for block in after["blocks"]} <= {"free", "cached"}
    assert all(block["ref_count"] == 0 and not block["owner_ids"] for block in after["blocks"])
    assert all(after["blocks"][b]["state"] == "cached" for b in prefix_blocks)
    assert after["num_free_blocks"] == NUM_KV_BLOCKS


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is missing: run .ci/install-debian-package.sh chromium chromium",
)
def test_dashboard_draws_every_block_and_the_running_requests_without_a_javascript_error(
    url, tmp_path
):
    stop = threading.Event()

    def load(index: int) -> None:  # one stream after another until the test is done
        body = {"prompt": PREFIX + [index], "max_tokens": 150, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
    for worker in workers:
        worker.start()
    browser = Browser()
    try:
        browser.navigate(f"{url}/dashboard")
        ready = "document.body !== null && document.body.dataset.ready === '1'"
        assert browser.wait_for(ready, timeout_s=60), browser.errors
        num_cells = browser.wait_for(
            f"document.querySelectorAll('#pool .block').length === {NUM_KV_BLOCKS}"
            " && document.querySelectorAll('#pool .block').length"
        )
        num_running = browser.wait_for(
            "document.querySelectorAll('.request-row[data-status=running]').length", timeout_s=60
        )
        browser.evaluate("document.querySelector('.request-row[data-status=running]').click()")
        num_selected = browser.wait_for("document.querySelectorAll('#pool .block.selected').length")
        num_arrows = browser.evaluate("document.querySelectorAll('#arrows path.link').length")
        time.sleep(1.5)  # a few more polls, so that the charts have points
        screenshot = browser.screenshot(tmp_path / "dashboard.png")
        errors = list(browser.errors)
    finally:
        browser.close()
        stop.set()
        for worker in workers:
            worker.join(timeout=TIMEOUT_S)

    keep = os.environ.get("DASHBOARD_SCREENSHOT_DIR")
    if keep:
        shutil.copy(screenshot, Path(keep) / "dashboard.png")
    assert num_cells == NUM_KV_BLOCKS
    assert num_running >= 1
    assert num_selected >= 1 and num_arrows == num_selected
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 20_000  # a drawn page, not a blank one
    assert errors == []
    wait_for_idle(url)
