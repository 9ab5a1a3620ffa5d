"""Acceptance: `pagedserve replicas -n 2` (real servers, default model, one core each) behind
sglang-router on loopback. Load spreads over both replicas, a shared long system prompt stays on
one replica under the cache-aware policy, SGLang's /generate and /flush_cache pass through it, and
a replica killed mid-run loses only what it held."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.deploy.support import dashboard_expressions, metric_names
from tests.replicas.support import Replicas, num_finished, pid_alive, scrape, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SYSTEM_PROMPT = " ".join(
    f"Rule {index}: answer politely, briefly and only about the paged KV cache of this server."
    for index in range(24)
)  # about 450 tokens: long enough that the cache-aware tree matches it over any question


@pytest.fixture(scope="module")
def replicas() -> Iterator[Replicas]:
    launched = Replicas(2, policy="cache_aware")
    yield launched
    launched.stop()


@dataclass
class Outcome:
    started: float
    ended: float
    status: int | None


def _complete(url: str, prompt: str, max_tokens: int = 4) -> Outcome:
    started = time.monotonic()
    try:
        response = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            timeout=120,
        )
        status = response.status_code if response.json()["choices"][0]["text"] else None
    except (httpx.HTTPError, ValueError, KeyError):
        status = None
    return Outcome(started, time.monotonic(), status)


def _chat(url: str, question: str) -> int:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    response = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    return response.status_code


def test_each_replica_is_pinned_to_its_own_core_with_one_thread(replicas):
    shares = [tuple(sorted(os.sched_getaffinity(r.pid))) for r in replicas.replicas]
    assert len(set(shares)) == 2 and not set(shares[0]) & set(shares[1]), shares
    for replica in replicas.replicas:
        environ = Path(f"/proc/{replica.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ


def test_forty_requests_all_succeed_and_both_replicas_serve_some(replicas):
    before = [num_finished(replica.url) for replica in replicas.replicas]
    prompts = [f"{index * 7919} is a number; its digits are" for index in range(40)]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda prompt: _complete(replicas.url, prompt), prompts))
    assert [outcome.status for outcome in outcomes] == [200] * 40
    served = [num_finished(r.url) - b for r, b in zip(replicas.replicas, before, strict=True)]
    assert sum(served) == 40 and min(served) > 0, served


def test_a_shared_system_prompt_concentrates_on_one_replica_with_prefix_hits(replicas):
    before = [scrape(replica.url) for replica in replicas.replicas]
    questions = [f"Question {index}: what is a block table?" for index in range(12)]
    with ThreadPoolExecutor(3) as pool:
        statuses = list(pool.map(lambda question: _chat(replicas.url, question), questions))
    assert statuses == [200] * 12
    after = [scrape(replica.url) for replica in replicas.replicas]

    def delta(index: int, name: str) -> float:
        return after[index][name] - before[index][name]

    served = [delta(index, "pagedserve:request_success_total") for index in (0, 1)]
    hits = [delta(index, "pagedserve:prefix_cache_hits_total") for index in (0, 1)]
    chosen = served.index(max(served))
    assert served[chosen] >= 11, served  # the first request may land anywhere, then they follow
    # Each later request finds the ~450 system-prompt tokens cached on the chosen replica.
    assert hits[chosen] >= 10 * 300, hits
    assert hits[1 - chosen] < hits[chosen] / 5, hits


def test_every_dashboard_metric_is_exported_by_a_real_replica(replicas):
    # After the requests above every histogram has samples; the dashboard reads only these names.
    exported = set(scrape(replicas.replicas[0].url))
    for expr in dashboard_expressions():
        assert metric_names(expr) <= exported, (expr, metric_names(expr) - exported)


def test_client_errors_do_not_take_a_replica_out_of_the_rotation(replicas):
    too_long = {"model": MODEL, "prompt": "Hi", "max_tokens": 100_000}
    for _ in range(6):
        response = httpx.post(replicas.url + "/v1/completions", json=too_long, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "max_tokens"  # our body, passed through
    before = [num_finished(replica.url) for replica in replicas.replicas]
    prompts = [f"{index * 31} and {index * 37} are" for index in range(8)]
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda prompt: _complete(replicas.url, prompt), prompts))
    assert [outcome.status for outcome in outcomes] == [200] * 8
    served = [num_finished(r.url) - b for r, b in zip(replicas.replicas, before, strict=True)]
    assert min(served) > 0, served


def test_sglang_s_generate_and_flush_cache_go_through_the_router(replicas):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3}}
    body["sampling_params"]["temperature"] = 0
    answers = [httpx.post(replicas.url + "/generate", json=body, timeout=120) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [200, 200]
    assert answers[0].json()["text"] == answers[1].json()["text"]
    assert answers[0].json()["meta_info"]["completion_tokens"] == 3
    flushed = httpx.post(replicas.url + "/flush_cache", timeout=60)  # fanned out to each replica
    assert flushed.status_code == 200, flushed.text


def test_killing_a_replica_mid_run_loses_only_its_in_flight_requests(replicas):
    survivor, victim = replicas.replicas
    prompts = [f"{index * 104729} divided by seven is" for index in range(24)]
    kill_time: list[float] = []

    def kill_after_some_finished() -> None:
        wait_for(lambda: num_finished(victim.url) + num_finished(survivor.url) >= base + 6, 120)
        kill_time.append(time.monotonic())
        os.kill(victim.pid, 9)

    base = num_finished(victim.url) + num_finished(survivor.url)
    with ThreadPoolExecutor(5) as pool:
        killer = pool.submit(kill_after_some_finished)
        outcomes = list(pool.map(lambda p: _complete(replicas.url, p, max_tokens=12), prompts))
        killer.result()
    (killed_at,) = kill_time
    assert wait_for(lambda: not pid_alive(victim.pid), 10)
    failed = [outcome for outcome in outcomes if outcome.status != 200]
    # A request can only be lost if it was in flight when the replica died ...
    assert all(o.started <= killed_at <= o.ended for o in failed), (killed_at, failed)
    assert len(failed) <= 4  # ... and at most the 4 other requests were in flight then
    # ... and every request sent after the kill succeeded, as do all later ones, on the survivor.
    assert all(o.status == 200 for o in outcomes if o.started > killed_at)
    survivor_before = num_finished(survivor.url)
    later = [_complete(replicas.url, f"Later request {index}:") for index in range(8)]
    assert [outcome.status for outcome in later] == [200] * 8
    assert num_finished(survivor.url) - survivor_before == 8
    assert replicas.process.poll() is None  # the launcher keeps serving with one replica
    assert any("replica 1 exited" in line for line in replicas.output)


def test_sigterm_to_the_launcher_stops_the_router_and_every_replica(replicas):
    pids = [replicas.router.pid] + [replica.pid for replica in replicas.replicas]
    assert replicas.stop() == 0
    assert wait_for(lambda: not any(pid_alive(pid) for pid in pids), 30), pids
