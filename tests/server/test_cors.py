"""CORS (`--allowed-origins`): off by default; when on, a listed origin's preflight is answered
before the API key is asked for, and its responses (errors too) carry the allow headers."""

from __future__ import annotations

import pytest

from pagedserve.configs import EngineConfig

APP = "https://app.example"
PREFLIGHT = {
    "origin": APP,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}
BODY = {"prompt": "hi", "max_tokens": 1}


def test_no_cors_headers_unless_origins_are_allowed(client):
    response = client.post("/v1/completions", json=BODY, headers={"origin": APP})
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    assert client.options("/v1/completions", headers=PREFLIGHT).status_code in (404, 405)


def test_an_allowed_origin_is_answered_before_the_key_is_asked_for(client_with):
    client = client_with(allowed_origins=f"{APP}, https://other.example", api_key="k")
    preflight = client.options("/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = client.post("/v1/completions", json=BODY, headers={"origin": APP})
    assert refused.status_code == 401  # the key is still required, and the page may read why
    assert refused.headers["access-control-allow-origin"] == APP
    served = client.post(
        "/v1/completions", json=BODY, headers={"origin": APP, "authorization": "Bearer k"}
    )
    assert served.status_code == 200
    assert served.headers["access-control-allow-origin"] == APP
    assert "x-request-id" in served.headers["access-control-expose-headers"]


def test_an_origin_not_listed_gets_no_allow_header(client_with):
    client = client_with(allowed_origins=APP)
    preflight = client.options(
        "/v1/completions", headers={**PREFLIGHT, "origin": "https://evil.example"}
    )
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers


def test_star_allows_any_origin(client_with):
    client = client_with(allowed_origins="*")
    response = client.post("/v1/completions", json=BODY, headers={"origin": "https://any.example"})
    assert response.headers["access-control-allow-origin"] == "*"


def test_https_needs_both_the_key_and_the_certificate():
    with pytest.raises(ValueError, match="both ssl_keyfile and ssl_certfile"):
        EngineConfig.model_validate({"server": {"ssl_keyfile": "key.pem"}})


def test_vllm_s_json_list_of_origins_is_read_too(client_with):
    client = client_with(allowed_origins=f'["{APP}"]')
    assert (
        client.options("/v1/completions", headers=PREFLIGHT).headers["access-control-allow-origin"]
        == APP
    )
    with pytest.raises(ValueError, match="JSON list of origin strings"):
        EngineConfig.model_validate({"server": {"allowed_origins": "[1, 2]"}})
