"""Fixtures for the reliability suite. The session-scoped `shared_server` is started once and
reused by the bad-input corpus, the schema fuzzer and the security tests; the shutdown test takes it
over (SIGTERM), and a later user transparently gets a fresh one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.support import AUTH, ServerProcess, SharedServer


@pytest.fixture(scope="session")
def shared_server() -> Iterator[SharedServer]:
    manager = SharedServer()
    yield manager
    manager.close()


@pytest.fixture
def server(shared_server: SharedServer) -> ServerProcess:
    return shared_server.get()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """A raw client with the API key, so that tests control the bytes of each body."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client
