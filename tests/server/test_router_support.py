"""The worker API that sglang-router calls (`/server_info`, `/model_info`, `/get_load`,
`/health_generate`) and the `vllm:` gauges that routers and autoscalers read."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.errors import EngineDeadError


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_names_the_model_and_the_engine_limits(client, path):
    response = client.get(path)
    assert response.status_code == 200
    info = response.json()
    assert "model_path" not in info  # else sglang-router fetches a tokenizer from the hub
    assert info["served_model_name"] == "fake-model"
    assert info["dp_size"] == 1
    assert info["max_running_requests"] == 64  # --max-num-seqs
    assert info["max_total_tokens"] == 8 * 4  # blocks x block size
    assert info["context_length"] == 64


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_says_it_is_a_generation_model(client, path):
    info = client.get(path).json()
    assert info["is_generation"] is True
    assert info["served_model_name"] == "fake-model"
    assert info["max_context_length"] == 64


def test_get_load_reports_requests_and_kv_tokens_in_sglangs_shape(client):
    # The fake engine: 1 running, 2 waiting, 7 of 8 blocks of 4 tokens free.
    assert client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 4}
    ]


def test_health_generate_runs_one_token_through_the_engine(client, engine):
    response = client.get("/health_generate")
    assert response.status_code == 200
    (request_id, _, params) = engine.requests[-1]
    assert request_id.startswith("health-") and params.max_tokens == 1


def test_health_generate_is_503_when_the_engine_cannot_generate(client, engine):
    engine.raise_on_generate = EngineDeadError("the engine loop died")
    response = client.get("/health_generate")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unhealthy"
    assert "EngineDeadError" in response.json()["error"]["message"]


def test_health_generate_is_503_when_the_engine_is_not_alive(client, engine):
    engine.is_alive = False
    assert client.get("/health_generate").status_code == 503


def test_router_endpoints_need_the_api_key_when_one_is_set(client_with):
    client = client_with(api_key="secret")
    assert client.get("/get_load").status_code == 401
    headers = {"Authorization": "Bearer secret"}
    assert client.get("/get_load", headers=headers).status_code == 200


def test_vllm_named_gauges_repeat_ours_for_routers_and_autoscalers(client):
    families = {
        family.name: family
        for family in text_string_to_metric_families(client.get("/metrics").text)
    }

    def value(name: str) -> float:
        (sample,) = families[name].samples
        assert sample.labels["model_name"] == "fake-model"
        return sample.value

    assert value("vllm:num_requests_waiting") == value("pagedserve:num_requests_waiting") == 2
    assert value("vllm:num_requests_running") == value("pagedserve:num_requests_running") == 1
    assert value("vllm:kv_cache_usage_perc") == value("pagedserve:kv_cache_usage_perc") == 0.125
    assert value("vllm:gpu_cache_usage_perc") == 0.125
    info = families["vllm:cache_config_info"].samples[0]
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("4", "8")
