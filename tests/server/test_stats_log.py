"""The periodic engine-stats line (server/stats_log.py): the interval's throughputs and hit rate,
nothing while idle, one line when the engine falls idle, and on/off with --log-stats."""

from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

from pagedserve.engine.outputs import EngineStats
from pagedserve.server.app import create_app
from pagedserve.server.cli import build_parser
from pagedserve.server.stats_log import StatsLine
from tests.server.conftest import make_config

IDLE = EngineStats(num_prefilled_tokens=100, num_generation_tokens=40, kv_cache_usage=0.0)


def test_a_busy_interval_gives_its_throughputs_load_and_hit_rate():
    line = StatsLine(IDLE, now=0.0)
    busy = EngineStats(
        num_requests_running=3,
        num_requests_waiting=1,
        kv_cache_usage=0.4125,
        num_prefilled_tokens=100 + 2_000,
        num_generation_tokens=40 + 250,
        prefix_cache_queries=1_000,
        prefix_cache_hits=625,
    )
    assert line.next_line(busy, now=10.0) == (
        "Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 62.5%"
    )


def test_idle_intervals_log_nothing_but_the_fall_to_idle_is_logged_once():
    line = StatsLine(IDLE, now=0.0)
    assert line.next_line(IDLE, now=10.0) is None  # idle from the start: silent
    working = EngineStats(
        num_requests_running=1, num_prefilled_tokens=100, num_generation_tokens=60
    )
    assert "Avg generation throughput: 4.0 tokens/s, Running: 1 reqs" in line.next_line(
        working, now=15.0
    )
    at_rest = EngineStats(num_prefilled_tokens=100, num_generation_tokens=60)
    assert line.next_line(at_rest, now=25.0) == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: n/a"
    )
    assert line.next_line(at_rest, now=35.0) is None


def test_waiting_requests_alone_keep_the_lines_coming():
    line = StatsLine(IDLE, now=0.0)
    queued = EngineStats(num_requests_waiting=5, num_prefilled_tokens=100, num_generation_tokens=40)
    assert "Waiting: 5 reqs" in line.next_line(queued, now=10.0)
    assert "Waiting: 5 reqs" in line.next_line(queued, now=20.0)


def test_preemptions_and_draft_acceptance_appear_when_the_interval_had_them():
    line = StatsLine(IDLE, now=0.0)
    stats = EngineStats(
        num_requests_running=2,
        num_prefilled_tokens=100,
        num_generation_tokens=90,
        num_preemptions=3,
        spec_num_draft_tokens=40,
        spec_num_accepted_tokens=30,
    )
    text = line.next_line(stats, now=10.0)
    assert text.endswith(", Preemptions: 3, Draft acceptance rate: 75.0%")
    calm = EngineStats(
        num_requests_running=2,
        num_prefilled_tokens=100,
        num_generation_tokens=95,
        num_preemptions=3,
        spec_num_draft_tokens=40,
        spec_num_accepted_tokens=30,
    )
    assert "Preemptions" not in line.next_line(calm, now=20.0)


@pytest.mark.parametrize("log_stats", [True, False])
def test_the_server_logs_lines_while_it_runs_unless_turned_off(engine, caplog, log_stats):
    # The fake engine reports running and waiting requests: a busy engine, every interval.
    config = make_config(log_stats=log_stats, log_stats_interval=0.02)
    with caplog.at_level(logging.INFO, logger="pagedserve.server.stats_log"):
        with TestClient(create_app(config, engine)):
            time.sleep(0.2)
        lines = [r.getMessage() for r in caplog.records if r.name == "pagedserve.server.stats_log"]
        count_at_stop = len(lines)
        time.sleep(0.1)  # the task is cancelled with the app
        assert len([r for r in caplog.records if r.name == "pagedserve.server.stats_log"]) == (
            count_at_stop
        )
    if log_stats:
        assert count_at_stop >= 2
        assert all("Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 12.5%" in t for t in lines)
    else:
        assert lines == []


def test_vllms_disable_log_stats_flag_turns_the_lines_off():
    args = build_parser().parse_args(["serve", "--disable-log-stats"])
    assert args.log_stats is False
    assert build_parser().parse_args(["serve", "--log-stats-interval", "5"]).log_stats_interval == 5
    assert "log_stats" not in vars(build_parser().parse_args(["serve"]))
