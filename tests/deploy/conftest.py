"""The server fixtures (`client`: the real app around the fake engine) for the dashboard test."""

from tests.server.conftest import app, client, engine  # noqa: F401 (fixtures)
