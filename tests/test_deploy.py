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


def config_of(name: str, container: dict):
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig
    from kvserve.services.plumbing.config_flags import from_args

    return from_args(GatewayConfig if name == "gateway.yaml" else ModelServiceConfig, parsed(container), name)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("name", ["gateway.yaml", "model-service.yaml"])
def test_ports_probes_and_scrape_annotations_match_the_flags(name):
    [deployment] = [d for d in documents(DEPLOY / name) if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    config = config_of(name, container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == port_of(config.listen)
    assert ports["metrics"] == port_of(config.metrics_listen)
    assert ports["health"] == port_of(config.health_listen)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:   # TLS on the gRPC port: probes go to the plaintext health port
            assert container[probe]["grpc"]["port"] == ports["health"], probe
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == ports["metrics"]
    for service in (d for d in documents(DEPLOY / name) if d["kind"] == "Service"):
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, port
    if name == "gateway.yaml":
        assert ports["http"] == port_of(config.http_listen)
    else:
        [manager] = deployment["spec"]["template"]["spec"]["initContainers"]
        kv_ports = {p["name"]: p["containerPort"] for p in manager["ports"]}
        assert kv_ports["metrics-kv"] == port_of(parsed(manager).metrics_listen)


@pytest.mark.parametrize("name", ["gateway.yaml", "model-service.yaml", "kvcache.yaml"])
def test_every_file_a_flag_names_is_a_key_of_a_mounted_secret(name):
    secrets = {d["metadata"]["name"]: d for d in documents(DEPLOY / "secrets.yaml") if d["kind"] == "Secret"}
    spec = pod_spec(name)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in spec.get("initContainers", []) + spec["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        for arg in container["args"]:
            if not arg.startswith("/etc/kvserve/"):
                continue
            folder, key = arg.rsplit("/", 1)
            secret = volumes[mounts[folder]]["secret"]["secretName"]
            assert key in secrets[secret]["stringData"], (arg, secret)


def test_every_disruption_budget_selects_its_deployments_pods():
    for path in MANIFESTS:
        docs = documents(path)
        for budget in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
            [deployment] = [d for d in docs if d["kind"] == "Deployment"]
            assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]


def test_workers_take_only_the_gateways_calls_and_tenants():
    [gateway] = pod_spec("gateway.yaml")["containers"]
    [model] = pod_spec("model-service.yaml")["containers"]
    gw, worker = config_of("gateway.yaml", gateway), config_of("model-service.yaml", model)
    assert gw.api_keys and not worker.api_keys and worker.trust_tenant_metadata
    assert worker.tls_client_ca == gw.worker_tls_ca and gw.worker_tls_cert and gw.tls_cert and worker.tls_cert
