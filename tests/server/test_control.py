"""The operating routes against the fake engine: SGLang's /flush_cache and vLLM's
/reset_prefix_cache reset only an idle engine's cache (SGLang's /flush_cache waits up to its
`timeout` for that), and /abort_request needs something to abort. Aborting running requests is
tested over TCP in tests/server/test_uvicorn.py; the real cache's reset in
tests/engine/test_async_engine.py and tests/server/test_e2e_generate.py."""

from __future__ import annotations

import threading

import pytest

from pagedserve.engine.errors import EngineDeadError
from pagedserve.server.routes.control import _names


def test_flush_cache_resets_an_idle_engine_s_cache_by_get_or_post(client, engine):
    for method in ("GET", "POST"):
        response = client.request(method, "/flush_cache")
        assert (response.status_code, response.text) == (200, "Cache flushed.\n")
    assert engine.prefix_cache_resets == 2


def test_flush_cache_while_busy_is_a_400_unless_idle_within_its_timeout(client, engine):
    engine.in_flight = 1
    response = client.post("/flush_cache")
    assert (
        response.status_code == 400 and "queued or running" in response.json()["error"]["message"]
    )
    threading.Timer(0.2, lambda: setattr(engine, "in_flight", 0)).start()
    assert client.post("/flush_cache?timeout=5").status_code == 200
    assert engine.prefix_cache_resets == 1
    for bad in ("-1", "abc", "601"):
        assert client.post(f"/flush_cache?timeout={bad}").status_code == 400


def test_reset_prefix_cache_is_vllm_s_empty_200_or_a_400(client, engine):
    response = client.post("/reset_prefix_cache")
    assert (response.status_code, response.text) == (200, "")
    assert client.post("/reset_prefix_cache?reset_external=true").status_code == 200
    engine.in_flight = 1
    assert client.post("/reset_prefix_cache").status_code == 400
    engine.in_flight = 0
    response = client.post("/reset_prefix_cache?reset_running_requests=true")
    assert response.json()["error"]["param"] == "reset_running_requests"
    assert engine.prefix_cache_resets == 2


def test_abort_request_needs_a_rid_or_abort_all_and_ignores_finished_ids(client, engine):
    response = client.post("/abort_request", json={})
    assert response.status_code == 400 and response.json()["error"]["param"] == "rid"
    assert client.post("/abort_request", json={"rid": "long-gone"}).status_code == 200
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert engine.aborted == []


def test_the_operating_routes_need_the_api_key(client_with):
    client = client_with(api_key="k")
    for path in ("/flush_cache", "/reset_prefix_cache", "/abort_request", "/generate"):
        assert client.post(path, json={"abort_all": True}).status_code == 401
    assert client.post("/flush_cache", headers={"Authorization": "Bearer k"}).status_code == 200


@pytest.mark.parametrize(
    ("rid", "request_id", "named"),
    [
        ("job", "job", True),
        ("job", "job_3", True),  # a /generate batch's prompt
        ("job_1", "job", True),  # one choice of an n > 1 request: the whole request
        ("job", "job_extra", False),
        ("job", "job-2", False),  # only the server's own ids name OpenAI prompts by "-"
        ("job_x", "job", False),
        ("0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef-1", True),
        ("job", "jobs", False),
    ],
)
def test_which_requests_a_rid_names(rid, request_id, named):
    assert _names(rid, request_id) is named


def test_an_engine_that_does_not_answer_a_reset_is_a_503(client, engine):
    async def stuck() -> bool:  # what AsyncEngine raises past its answer timeout
        raise EngineDeadError("the engine did not answer a cache reset in time")

    engine.reset_prefix_cache = stuck  # type: ignore[method-assign]
    assert client.post("/flush_cache").status_code == 503
    assert client.post("/reset_prefix_cache").status_code == 503


def test_profiles_are_served_only_with_a_profiler_dir(client_with, tmp_path):
    assert client_with().post("/start_profile").status_code == 404  # off by default, as vLLM
    client = client_with(profiler_dir=str(tmp_path))
    assert client.post("/stop_profile").json()["error"]["message"].startswith("no profile")
    assert client.post("/start_profile").json() == {"status": "profiling"}
    assert client.post("/start_profile").status_code == 400  # one at a time
    stopped = client.post("/stop_profile").json()
    assert stopped["status"] == "stopped" and stopped["trace"] == str(tmp_path / "trace.json")
