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
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))   # the fleet's, and deploy/examples/


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_spec(name: str) -> dict:
    [deployment] = [d for d in documents(DEPLOY / name) if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def parsed(container: dict):
    args = container["args"]
    assert args[0] == "kvserve", args
    return build_parser().parse_args(args[1:])


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_kubernetes(path):
    for doc in documents(path):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_container_runs_flags_kvserve_accepts(path):
    for doc in documents(path):
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                config_of(container)   # argparse exits on an unknown flag; the config checks the values
                assert container["imagePullPolicy"] == "IfNotPresent" and not container["image"].endswith(":latest")


def test_the_fleet_applied_as_a_folder_creates_no_placeholder_secret_and_has_its_volume():
    """`kubectl apply -f deploy/` (not recursive) must not write placeholder Secrets over the real
    ones on a re-apply; the checkpoints' claim both Deployments mount is there."""
    fleet = [d for path in DEPLOY.glob("*.yaml") for d in documents(path)]
    assert not any(d["kind"] == "Secret" for d in fleet)
    claims = {d["metadata"]["name"]: d for d in fleet if d["kind"] == "PersistentVolumeClaim"}
    for name in ("model-service.yaml", "gateway.yaml"):
        for volume in pod_spec(name)["volumes"]:
            if "persistentVolumeClaim" in volume:
                claim = claims[volume["persistentVolumeClaim"]["claimName"]]
                assert "ReadWriteMany" in claim["spec"]["accessModes"]   # filled once, then read by pods on many nodes


def test_every_pod_meets_the_restricted_pod_security_standard():
    for path in MANIFESTS:
        for doc in (d for d in documents(path) if d["kind"] == "Deployment"):
            spec = doc["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["seccompProfile"] == {
                "type": "RuntimeDefault"}, path.name
            for container in spec.get("initContainers", []) + spec["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]


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
    from kvserve.model_service import lane_server
    from kvserve.services.plumbing.grpc_server import LAST_MESSAGES_S

    spec = pod_spec("model-service.yaml")
    [manager] = spec["initContainers"]
    [model] = spec["containers"]
    # a native sidecar: started first, restarted when it dies, stopped after the main containers
    assert manager["restartPolicy"] == "Always"
    kv, served = config_of(manager), config_of(model)
    assert (parsed(manager).num_pages, parsed(manager).page_size) == (served.num_pages, served.page_size)
    assert served.kvcache in kv.listen   # the socket, on the volume both mount at one path
    socket_dir = served.kvcache.removeprefix("unix://").rsplit("/", 1)[0]
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (manager, model)]
    assert mounts[0][socket_dir] == mounts[1][socket_dir]
    # the model service's whole drain (model_service/server.py: the grace, 2 s for the streams'
    # ends, 5 s for their open streams, 1 s for the relayed event streams, the lane's close, the
    # server's stop), then the manager's own, in one period
    lane_close = LAST_MESSAGES_S + lane_server.CLOSE_WAIT_S if served.lane_listen else 0
    drain = served.grace_s + 2 + 5 + 1 + lane_close + LAST_MESSAGES_S + kv.grace_s
    assert drain <= spec["terminationGracePeriodSeconds"], drain
    assert model["livenessProbe"]["grpc"]["service"] == "liveness"
    assert "service" not in model["readinessProbe"]["grpc"]
    assert manager["livenessProbe"]["grpc"]["port"] == port_of(kv.health_listen)


def test_the_gateway_leaves_the_service_before_it_drains_and_drains_in_its_period():
    from kvserve.services.http.server import HTTP_STOP_S
    from kvserve.services.plumbing.grpc_server import LAST_MESSAGES_S

    spec = pod_spec("gateway.yaml")
    [gateway] = spec["containers"]
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = int(pre_stop[1]) + config_of(gateway).grace_s + 2 + LAST_MESSAGES_S + HTTP_STOP_S
    assert drain <= spec["terminationGracePeriodSeconds"], drain


def config_of(container: dict):
    """The container's config, as its command builds and checks it."""
    from kvserve.kvcache_service.config import KVCacheServerConfig
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig
    from kvserve.services.plumbing.config_flags import from_args

    command = container["args"][1]
    kind = {"gateway": GatewayConfig, "model": ModelServiceConfig, "kvcache": KVCacheServerConfig}[command]
    return from_args(kind, parsed(container), command)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("name", ["gateway.yaml", "model-service.yaml"])
def test_ports_probes_and_scrape_annotations_match_the_flags(name):
    [deployment] = [d for d in documents(DEPLOY / name) if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    config = config_of(container)
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


@pytest.mark.parametrize("name", ["gateway.yaml", "model-service.yaml", "examples/kvcache.yaml"])
def test_every_file_a_flag_names_is_a_key_of_a_mounted_secret(name):
    secrets = {d["metadata"]["name"]: d for d in documents(DEPLOY / "examples/secrets.yaml") if d["kind"] == "Secret"}
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
    gw, worker = config_of(gateway), config_of(model)
    assert gw.api_keys and not worker.api_keys and worker.trust_tenant_metadata
    assert worker.tls_client_ca == gw.worker_tls_ca and gw.worker_tls_cert and gw.tls_cert and worker.tls_cert
