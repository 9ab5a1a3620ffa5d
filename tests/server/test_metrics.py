"""/metrics parses as Prometheus text and exposes every vLLM-style metric under `pagedserve:`."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.errors import EngineOverloadedError, InvalidRequestError

ENGINE_GAUGES = [
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "kv_cache_usage_perc",
    "num_free_blocks",
    "num_used_blocks",
]
COUNTERS = [
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "request_success",
    "request_aborted",
    "structured_output_requests",
]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "grammar_bitmask_seconds",
]


def _scrape(client) -> dict[str, object]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def test_metrics_expose_every_name_with_the_model_label(client):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    families = _scrape(client)
    expected = [*ENGINE_GAUGES, *COUNTERS, *HISTOGRAMS, "cache_config_info"]
    assert {f"pagedserve:{name}" for name in expected} <= set(families)
    for name in expected:
        for sample in families[f"pagedserve:{name}"].samples:
            assert sample.labels["model_name"] == "fake-model", sample


def test_counters_are_exposed_with_the_total_suffix(client):
    text = client.get("/metrics").text
    for name in COUNTERS:
        assert f"\npagedserve:{name}_total{{" in text


def test_engine_gauges_are_read_at_scrape_time(client, engine):
    families = _scrape(client)
    assert families["pagedserve:num_free_blocks"].samples[0].value == 7
    assert families["pagedserve:num_used_blocks"].samples[0].value == 1
    assert families["pagedserve:kv_cache_usage_perc"].samples[0].value == 0.125
    assert families["pagedserve:generation_tokens"].samples[0].value == 5
    assert families["pagedserve:structured_output_requests"].samples[0].value == 2
    info = families["pagedserve:cache_config_info"].samples[0]
    assert (info.labels["block_size"], info.labels["num_blocks"]) == ("4", "8")
    assert info.labels["cache_dtype"] == "fp8_e4m3"


def test_request_histograms_and_finish_reasons_are_observed(client):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2})
    client.post("/v1/completions", json={"prompt": "hi"})
    samples = {
        (s.name, s.labels.get("finished_reason")): s.value
        for family in _scrape(client).values()
        for s in family.samples
    }
    assert samples[("pagedserve:request_success_total", "length")] == 2
    assert samples[("pagedserve:request_success_total", "stop")] == 1
    assert samples[("pagedserve:request_success_total", "abort")] == 0
    assert samples[("pagedserve:time_to_first_token_seconds_count", None)] == 3
    assert samples[("pagedserve:inter_token_latency_seconds_count", None)] == 2 * 2 + 8
    assert samples[("pagedserve:request_queue_time_seconds_count", None)] == 2
    assert samples[("pagedserve:request_generation_tokens_sum", None)] == 3 + 3 + 9
    assert samples[("pagedserve:iteration_tokens_total_count", None)] == 2  # drained per scrape


def test_requests_the_engine_refuses_are_not_counted_as_finished(client, engine):
    engine.raise_on_generate = EngineOverloadedError("busy")
    assert client.post("/v1/completions", json={"prompt": "hi", "n": 2}).status_code == 429
    engine.raise_on_generate = InvalidRequestError("no", "prompt")
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 400
    samples = {
        (s.name, s.labels.get("finished_reason")): s.value
        for family in _scrape(client).values()
        for s in family.samples
    }
    assert (
        sum(
            value
            for (name, _), value in samples.items()
            if name == "pagedserve:request_success_total"
        )
        == 0
    )
    assert samples.get(("pagedserve:e2e_request_latency_seconds_count", None), 0) == 0
    assert samples.get(("pagedserve:request_prompt_tokens_count", None), 0) == 0


def test_grammar_mask_times_are_drained_into_their_histogram_at_scrape(client):
    families = _scrape(client)  # the fake engine reports one 2 ms step per scrape
    samples = {s.name: s.value for s in families["pagedserve:grammar_bitmask_seconds"].samples}
    assert samples["pagedserve:grammar_bitmask_seconds_count"] == 1
    assert samples["pagedserve:grammar_bitmask_seconds_sum"] == 0.002


def test_speculative_decoding_counters_are_exposed(client_with, engine, monkeypatch):
    stats = dataclasses.replace(
        engine.stats(),
        spec_num_drafts=4,
        spec_num_draft_tokens=12,
        spec_num_accepted_tokens=7,
        spec_num_accepted_per_position=(4, 2, 1),
    )
    monkeypatch.setattr(type(engine), "stats", lambda self: stats)  # before the app binds it
    families = _scrape(client_with())
    for name, value in [("num_drafts", 4), ("num_draft_tokens", 12), ("num_accepted_tokens", 7)]:
        assert families[f"pagedserve:spec_decode_{name}"].samples[0].value == value
    per_position = families["pagedserve:spec_decode_num_accepted_tokens_per_pos"].samples
    assert {s.labels["position"]: s.value for s in per_position} == {"0": 4, "1": 2, "2": 1}
