"""GET /v1/engine/state and GET /dashboard against a fake engine: on by default for a loopback
bind and off for any other unless enabled (then a 404 with an OpenAI error body); the state needs
the API key and the page does not; the page is a few static files that load nothing from
elsewhere and are shipped with the package; in headless Chromium (where installed) the page asks
for the key and draws the pool once given it."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from importlib.resources import files

import pytest
import uvicorn

from pagedserve.configs.engine import ServerConfig, is_loopback_host
from pagedserve.engine.outputs import EngineStats
from pagedserve.engine.state import EngineState
from pagedserve.scheduler.snapshot import PlannedRequest, PlanSnapshot, RequestSnapshot
from pagedserve.server.app import create_app
from pagedserve.server.routes.engine_state import DASHBOARD_FILES
from tests.server.chromium import CHROMIUM, Browser
from tests.server.conftest import FakeEngine, make_config
from tests.server_process import free_port

RUNNING = RequestSnapshot("r-0#0", "running", 5, 2, 6, 4, 0, 0, None, [1, 0])


class StateEngine(FakeEngine):
    async def engine_state(self) -> EngineState:
        return EngineState(
            time=1.5,
            num_steps=7,
            block_size=4,
            num_blocks=3,
            num_free_blocks=1,
            enable_prefix_caching=True,
            block_states=["in_use", "in_use", "cached"],
            ref_counts=[1, 1, 0],
            owner_ids=[["r-0#0"], ["r-0#0"], []],
            is_hashed=[False, True, True],
            running=[RUNNING],
            waiting=[],
            last_plan=PlanSnapshot([PlannedRequest("r-0#0", 1, 6, True)], 1, 512, 0),
            stats=EngineStats(num_generation_tokens=2),
        )


@pytest.fixture
def engine() -> StateEngine:
    return StateEngine()


def test_engine_state_is_served_as_json_on_a_loopback_bind(client):
    response = client.get("/v1/engine/state")
    assert response.status_code == 200
    body = response.json()
    assert (body["object"], body["model"], body["num_steps"]) == ("engine.state", "fake-model", 7)
    assert body["blocks"] == {  # columnar: one list per field, indexed by block id
        "state": ["in_use", "in_use", "cached"],
        "ref_count": [1, 1, 0],
        "owner_ids": [["r-0#0"], ["r-0#0"], []],
        "is_hashed": [False, True, True],
    }
    assert body["running"][0]["block_table"] == [1, 0]
    assert body["running"][0]["num_computed_tokens"] == 6
    assert body["last_plan"]["requests"] == [
        {"sequence_id": "r-0#0", "num_new_tokens": 1, "start_position": 6, "needs_sample": True}
    ]
    assert body["stats"]["num_generation_tokens"] == 2
    assert body["waiting"] == []
    assert body["last_plan"]["token_budget"] == 512
    assert response.headers["cache-control"] == "no-store"


@pytest.mark.parametrize("path", ["/v1/engine/state", *DASHBOARD_FILES])
def test_engine_state_and_dashboard_are_404_on_a_public_bind_unless_enabled(client_with, path):
    response = client_with(host="0.0.0.0").get(path)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "engine_state_disabled"
    assert "--enable-engine-state" in error["message"]
    assert client_with(host="0.0.0.0", enable_engine_state=True).get(path).status_code == 200


def test_engine_state_can_be_turned_off_on_a_loopback_bind(client_with):
    response = client_with(host="127.0.0.1", enable_engine_state=False).get("/v1/engine/state")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_engine_state_needs_the_api_key_and_the_dashboard_page_does_not(client_with):
    client = client_with(api_key="secret")
    refused = client.get("/v1/engine/state")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    authorized = client.get("/v1/engine/state", headers={"Authorization": "Bearer secret"})
    assert authorized.status_code == 200
    for path in DASHBOARD_FILES:
        assert client.get(path).status_code == 200, path
    assert client.get("/dashboard/other.js").status_code == 401  # only the page's own files


def test_dashboard_files_have_their_media_types_and_a_same_origin_policy(client):
    for path, (_, media_type) in DASHBOARD_FILES.items():
        response = client.get(path)
        assert response.headers["content-type"] == media_type
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "connect-src 'self'" in policy
        assert response.headers["x-content-type-options"] == "nosniff"


def test_dashboard_page_loads_nothing_from_another_origin(client):
    html = client.get("/dashboard").text
    # Relative to the page (/dashboard), so that a proxy's path prefix is kept.
    assert '<script type="module" src="dashboard/dashboard.js">' in html
    assert '<link rel="stylesheet" href="dashboard/dashboard.css">' in html
    for path in DASHBOARD_FILES:
        text = client.get(path).text
        # The only absolute URL allowed is the SVG namespace, which is a name, not a fetch.
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (path, urls)
    scripts = {path: client.get(path).text for path in DASHBOARD_FILES if path.endswith(".js")}
    assert 'fetch("v1/engine/state"' in scripts["/dashboard/dashboard.js"]
    for path, script in scripts.items():
        assert "innerHTML" not in script, path  # request ids are shown with textContent only
        for module in re.findall(r'from "\./([\w.]+)"', script):  # every import is served
            assert f"/dashboard/{module}" in DASHBOARD_FILES, (path, module)


def test_dashboard_files_are_package_data():
    static = files("pagedserve.server") / "static"
    for name, _ in DASHBOARD_FILES.values():
        assert (static / name).is_file(), name


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback_hosts_are_recognised(host, expected):
    assert is_loopback_host(host) is expected
    assert ServerConfig(host=host).engine_state_enabled is expected
    assert ServerConfig(host=host, enable_engine_state=not expected).engine_state_enabled is (
        not expected
    )


@pytest.fixture
def keyed_server_url() -> Iterator[str]:
    """A real uvicorn server (in a thread) around the fake engine, with an API key."""
    app = create_app(make_config(api_key="secret"), StateEngine())
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is missing: run .ci/install-debian-package.sh chromium chromium",
)
def test_dashboard_asks_for_the_api_key_and_draws_once_given_it(keyed_server_url):
    browser = Browser(width=1200, height=800)
    try:
        browser.navigate(f"{keyed_server_url}/dashboard")
        asked = browser.wait_for(
            "!!document.getElementById('key-form')"
            " && !document.getElementById('key-form').classList.contains('hidden')"
        )
        status = browser.evaluate("document.getElementById('status-text').textContent")
        browser.evaluate(
            "document.getElementById('key-input').value = 'secret';"
            "document.getElementById('key-save').click()"
        )
        drawn = browser.wait_for(
            "document.body.dataset.ready === '1' && document.querySelectorAll('#pool .block').length"
        )
        rows = browser.evaluate(
            "document.querySelectorAll('.request-row[data-status=running]').length"
        )
        shared_text = browser.evaluate("document.getElementById('c-cached').textContent")
        errors = [e for e in browser.errors if "401" not in e]  # the refused poll is expected
    finally:
        browser.close()
    assert asked and status == "needs API key"
    assert (drawn, rows, shared_text) == (3, 1, "1")
    assert errors == []


def test_owner_ids_with_quotes_backslashes_and_non_ascii_come_back_exactly():
    """Sequence ids embed the caller's x-request-id: any text must survive the JSON."""
    import asyncio
    import dataclasses
    import json

    from pagedserve.server.routes.engine_state import state_to_json

    state = asyncio.run(StateEngine().engine_state())
    tricky = ['a"b#0', "c\\\\d#1", "über\\n#2"]
    state = dataclasses.replace(state, owner_ids=[tricky[:2], [tricky[2]], []])
    body = json.loads(state_to_json(state, 'm"odel'))
    assert body["blocks"]["owner_ids"] == state.owner_ids
    assert body["model"] == 'm"odel'
    assert body["running"] == [json.loads(json.dumps(dataclasses.asdict(RUNNING)))]
