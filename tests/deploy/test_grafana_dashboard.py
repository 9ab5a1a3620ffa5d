"""The committed Grafana dashboard: it validates against a schema of what Grafana needs from a
provisioned dashboard, Prometheus parses each of its expressions, and every metric they name is
exported by pagedserve's /metrics (the real renderer; `tests/replicas/` repeats the name check
against a real server with the default model)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.support import (
    DASHBOARD,
    REPO_ROOT,
    dashboard,
    dashboard_expressions,
    grafana_to_promql,
    metric_names,
)

SCHEMA = json.loads((Path(__file__).parent / "grafana_dashboard.schema.json").read_text())
PROVISIONING = REPO_ROOT / "deploy" / "grafana" / "provisioning"


def test_the_dashboard_validates_against_the_grafana_dashboard_schema():
    jsonschema.validate(dashboard(), SCHEMA)


def test_the_schema_rejects_a_panel_without_a_query():
    broken = dashboard()
    del broken["panels"][0]["targets"][0]["expr"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_the_dashboard_covers_every_view_the_replicas_need():
    titles = " | ".join(panel["title"].lower() for panel in dashboard()["panels"])
    for view in ("request rate", "first token", "per output token", "waiting", "blocks in use"):
        assert view in titles, view
    assert "prefix-cache hit rate" in titles
    for expr in dashboard_expressions():  # per replica: every series keeps its instance
        assert "by (instance" in expr, expr


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    panels = dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = [
        (panel["gridPos"]["x"] + dx, panel["gridPos"]["y"] + dy)
        for panel in panels
        for dx in range(panel["gridPos"]["w"])
        for dy in range(panel["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_prometheus_parses_every_dashboard_expression(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{index}", "expr": grafana_to_promql(expr)}
                    for index, expr in enumerate(dashboard_expressions())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_metric_is_exported_by_pagedserve(client):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})  # fills histograms
    exported = {
        sample.name
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
    }
    for expr in dashboard_expressions():
        assert metric_names(expr), expr
        assert metric_names(expr) <= exported, (expr, metric_names(expr) - exported)


def test_grafana_provisioning_points_at_the_dashboard_and_the_datasource_it_uses():
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["uid"] == "prometheus"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "pagedserve.yml").read_text())[
        "providers"
    ]
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert DASHBOARD.parent.name == "dashboards"
