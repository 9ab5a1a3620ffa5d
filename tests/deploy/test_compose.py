"""docker-compose.yml: `docker-compose config` (Debian's docker-compose, which validates against
the Compose schema without a Docker daemon; `make test` installs it) accepts it and rejects a broken
copy, and the services agree with each other: every replica is a router worker and a Prometheus
target, each on its own core."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.support import REPO_ROOT

COMPOSE = REPO_ROOT / "docker-compose.yml"
needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose missing: bash .ci/install-debian-package.sh docker-compose docker-compose",
)


def _config(path: Path) -> subprocess.CompletedProcess[str]:
    command = ["docker-compose", "--project-directory", str(REPO_ROOT), "-f", str(path)]
    return subprocess.run([*command, "config"], capture_output=True, text=True, timeout=60)


@needs_compose
def test_docker_compose_config_accepts_the_compose_file():
    result = _config(COMPOSE)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert {"replica-0", "replica-1", "router", "prometheus", "grafana"} <= set(
        resolved["services"]
    )


@needs_compose
def test_docker_compose_config_rejects_a_broken_copy(tmp_path):
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["router"]["ports"] = {"not": "a list"}
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = _config(path)
    assert result.returncode != 0
    assert "ports" in result.stderr


def _resolved() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the anchors and merge keys


def test_every_replica_is_a_router_worker_and_a_prometheus_target_on_its_own_core():
    services = _resolved()["services"]
    replicas = sorted(name for name in services if name.startswith("replica-"))
    assert len(replicas) >= 2
    router_args = services["router"]["command"]
    workers = router_args[router_args.index("--worker-urls") + 1 :]
    assert workers == [f"http://{name}:8000" for name in replicas]
    prometheus = yaml.safe_load((REPO_ROOT / "configs" / "prometheus.yml").read_text())
    (job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "pagedserve"]
    assert job["static_configs"][0]["targets"] == [f"{name}:8000" for name in replicas]
    cpusets = [services[name]["cpuset"] for name in replicas]
    assert len(set(cpusets)) == len(cpusets)
    for name in replicas:
        assert services[name]["environment"]["OMP_NUM_THREADS"] == "1"
        assert services[name]["build"]["args"]["PROJECT_EXTRAS"] == "router"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promtool_accepts_the_prometheus_config():
    path = REPO_ROOT / "configs" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
