"""The Kubernetes manifests: valid against the API schema, every container's args accepted by
the real `kvserve` parser, and the pod's shape the fault tolerance relies on (the manager a
native sidecar that outlives the model service's drain; liveness only for a stalled engine)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.services.cli.main import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_spec(name: str) -> dict:
    [deployment] = [d for d in documents(DEPLOY / name) if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def parsed(container: dict):
    args = container["args"]
    assert args[0] == "kvserve", args
    return build_parser().parse_args(args[1:])


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_kubernetes(path):
    for doc in documents(path):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_container_runs_flags_kvserve_accepts(path):
    for doc in documents(path):
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                parsed(container)   # argparse exits on an unknown flag


def test_the_gateway_follows_the_workers_headless_service_with_their_checkpoint_and_salt():
    services = {d["metadata"]["name"]: d for d in documents(DEPLOY / "model-service.yaml") if d["kind"] == "Service"}
    [model] = pod_spec("model-service.yaml")["containers"]
    [gateway] = pod_spec("gateway.yaml")["containers"]
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig
    from kvserve.services.plumbing.config_flags import from_args

    gw = from_args(GatewayConfig, parsed(gateway), "gateway")
    worker = from_args(ModelServiceConfig, parsed(model), "model")
    name, port = gw.workers_dns.split(":")
    headless = services[name]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == pod_template_labels("model-service.yaml")
    assert int(port) == int(worker.listen.rsplit(":", 1)[1]) == headless["ports"][0]["port"]
    assert (gw.model, gw.cache_salt) == (worker.model, worker.cache_salt)
    assert gateway["livenessProbe"]["grpc"]["service"] == "liveness"


def pod_template_labels(name: str) -> dict:
    [deployment] = [d for d in documents(DEPLOY / name) if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_the_manager_is_a_sidecar_that_outlives_the_model_services_drain():
    spec = pod_spec("model-service.yaml")
    [manager] = spec["initContainers"]
    [model] = spec["containers"]
    # a native sidecar: started first, restarted when it dies, stopped after the main containers
    assert manager["restartPolicy"] == "Always"
    kv, served = parsed(manager), parsed(model)
    assert (kv.num_pages, kv.page_size) == (served.num_pages, served.page_size)
    assert served.grace_s + 5 <= spec["terminationGracePeriodSeconds"]
    assert model["livenessProbe"]["grpc"]["service"] == "liveness"
    assert "service" not in model["readinessProbe"]["grpc"]
