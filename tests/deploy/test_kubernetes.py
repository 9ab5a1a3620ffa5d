"""deploy/kubernetes/: every built-in resource validates strictly against Kubernetes' own OpenAPI
schemas (`kubernetes-validate`, offline); the ServiceMonitor, a Prometheus Operator CRD that
those schemas lack, validates against the subset of the CRD's schema written in
servicemonitor.schema.json. Then the resources are checked against each other (selectors, ports,
probes, the router's pod selector, the HPA's target)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.support import KUBERNETES

KUBERNETES_VERSION = "1.30.0"  # a current release the validator ships schemas for
CRD_SCHEMAS = {
    "ServiceMonitor": json.loads((Path(__file__).parent / "servicemonitor.schema.json").read_text())
}


def _resources() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    return [
        resource
        for name in kustomization["resources"]
        for resource in yaml.safe_load_all((KUBERNETES / name).read_text())
    ]


def _one(kind: str, name: str) -> dict[str, Any]:
    (resource,) = [r for r in _resources() if (r["kind"], r["metadata"]["name"]) == (kind, name)]
    return resource


def _validate(resource: dict[str, Any]) -> None:
    if resource["kind"] in CRD_SCHEMAS:
        jsonschema.validate(resource, CRD_SCHEMAS[resource["kind"]])
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"])
    assert listed == {path.name for path in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(
    "resource", _resources(), ids=lambda r: f"{r['kind']}/{r['metadata']['name']}"
)
def test_every_manifest_validates_against_its_schema(resource):
    _validate(resource)


def test_the_validators_reject_broken_manifests():
    deployment = copy.deepcopy(_one("Deployment", "pagedserve"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)
    typo = copy.deepcopy(_one("Deployment", "pagedserve"))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # strict: unknown
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    monitor = copy.deepcopy(_one("ServiceMonitor", "pagedserve"))
    monitor["spec"]["endpoints"][0]["interval"] = "often"
    with pytest.raises(jsonschema.ValidationError):
        _validate(monitor)


def test_replicas_have_probes_resources_and_a_startup_window_for_model_conversion():
    container = _one("Deployment", "pagedserve")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] in ("/v1/models", "/health")
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    requests = container["resources"]["requests"]
    assert requests["cpu"] == "1" and "memory" in requests
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["OMP_NUM_THREADS"] == requests["cpu"]  # one thread per requested core


def test_services_monitors_and_the_router_select_the_replica_pods():
    deployment = _one("Deployment", "pagedserve")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = _one("Service", "pagedserve")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = _one("ServiceMonitor", "pagedserve")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= service_ports
    args = _one("Deployment", "pagedserve-router")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--service-discovery" in args
    selector = args[args.index("--selector") + 1 : args.index("--selector") + 3]
    assert dict(item.split("=") for item in selector).items() <= pod_labels.items()


def test_the_hpa_scales_the_replica_deployment_on_waiting_requests():
    hpa = _one("HorizontalPodAutoscaler", "pagedserve")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagedserve"
    (metric,) = hpa["spec"]["metrics"]
    # The adapter's name for the gauge vllm:num_requests_waiting (see server/metrics_aliases.py).
    assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
