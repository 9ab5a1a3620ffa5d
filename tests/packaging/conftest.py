"""Packaging-test options: the container smoke test builds an image (minutes), so it is opt-in."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-docker",
        action="store_true",
        default=False,
        help="build and run the container image with podman (make docker-smoke)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "docker: builds and runs the container image (needs --run-docker)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-docker"):
        return
    skip = pytest.mark.skip(reason="container smoke test: pass --run-docker (make docker-smoke)")
    for item in items:
        if "docker" in item.keywords:
            item.add_marker(skip)
