"""Shared by the deployment tests: the repository's deployment files, and the metric names that
a PromQL expression reads (checked against what a real /metrics exports)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "pagedserve.json"
KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"

# PromQL words and the label names our dashboard groups by: everything else is a metric name.
_PROMQL_WORDS = frozenset(
    [
        "sum",
        "max",
        "min",
        "avg",
        "count",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "rate",
        "irate",
        "increase",
        "histogram_quantile",
        "instance",
        "le",
        "job",
        "model_name",
    ]
)
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def grafana_to_promql(expr: str) -> str:
    """Grafana's `$__rate_interval` is resolved by Grafana; Prometheus needs a real range."""
    return expr.replace("$__rate_interval", "1m")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers outside string literals and range brackets
    that are neither PromQL words nor grouping labels."""
    without_strings = re.sub(r'"[^"]*"', "", grafana_to_promql(expr))
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_strings)
    return {name for name in _IDENTIFIER.findall(without_ranges) if name not in _PROMQL_WORDS}
