"""A regular (non-editable) install puts one import name into site-packages: `pagedserve`.

The repository's folders `server/ engine/ scheduler/ cache/ configs/ benchmarks/` install as
`pagedserve.server`, ..., so they never collide with another distribution's `server` or `cache`.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["server", "engine", "scheduler", "cache", "configs", "benchmarks"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w"]
        + [str(out), str(REPO_ROOT)],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("pagedserve-*.whl")
    return path


def test_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {entry for entry in top_level if not entry.endswith(".dist-info")} == {"pagedserve"}
    for layer in LAYERS:
        assert f"pagedserve/{layer}/__init__.py" in names
    from pagedserve.cache.attention.cpu import _HEADERS, _SOURCES

    for source in (*_SOURCES, *_HEADERS):  # everything the kernel build reads
        assert f"pagedserve/cache/attention/csrc/{source.name}" in names
    assert "pagedserve/benchmarks/csrc/paged_read.cpp" in names  # the attention benchmark's
    assert any(name.startswith("pagedserve/configs/presets/") for name in names)
    for name in (
        "dashboard.html",
        "dashboard.css",
        "dashboard.js",
        "charts.js",
        "util.js",
    ):  # the /dashboard page
        assert f"pagedserve/server/static/{name}" in names
    assert not any(name.startswith("pagedserve/tests/") for name in names)


def test_installed_wheel_exports_llm_and_sampling_params_and_no_bare_layers(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + [str(wheel)],
        check=True,
        timeout=300,
    )
    # `bin/` holds the console script; everything importable is under `pagedserve/`.
    installed = {path.name for path in target.iterdir() if not path.name.endswith(".dist-info")}
    assert installed - {"bin"} == {"pagedserve"}
    check = (
        "import importlib.util, pagedserve\n"
        "from pagedserve import LLM, SamplingParams, AsyncEngine, __version__\n"
        f"assert pagedserve.__file__.startswith({str(target)!r}), pagedserve.__file__\n"
        f"bare = [m for m in {LAYERS!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not bare, bare\n"
        "print(__version__)\n"
    )
    # The installed copy comes first on the path; torch and the other dependencies come from this
    # environment. The working directory is empty, so the repository's folders are out of reach.
    result = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.1.0"
