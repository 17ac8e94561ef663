"""deploy/keda.yaml: whole servers in a Deployment, scaled by KEDA on `vllm:num_requests_waiting`. No Kubernetes
here: the Deployment, Service and ConfigMap are checked against Kubernetes' own schemas (kubernetes-validate), the
served config against Ray Serve's schema and the app's args, the KEDA and Prometheus-operator objects by the fields
those operators read, and the trigger's query against the series `/metrics` serves under `metrics_names: vllm`."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app
from tests.tooling.test_grafana import VLLM_DASHBOARD_SERIES, VLLM_MORE_SERIES

ROOT = Path(__file__).resolve().parents[2]
OBJECTS = {doc["kind"]: doc for doc in yaml.safe_load_all((ROOT / "deploy" / "keda.yaml").read_text())}
SERVE_CONFIG = ServeDeploySchema.model_validate(yaml.safe_load(OBJECTS["ConfigMap"]["data"]["serve_config.yaml"]))


@pytest.mark.parametrize("kind", ["ConfigMap", "Deployment", "Service"])
def test_the_kubernetes_objects_are_valid(kind: str) -> None:
    kubernetes_validate.validate(OBJECTS[kind], kubernetes_validate.latest_version(), strict=True)


def test_each_pod_serves_the_config_map_with_vllms_metric_names(tmp_path: Path) -> None:
    (app,) = SERVE_CONFIG.applications
    assert app.args["metrics_names"] == "vllm" and SERVE_CONFIG.http_options.host == "0.0.0.0"
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"sk-test": {"tenant": "t"}}))
    (tmp_path / "secret").write_text("s")
    build_app({**app.args, "api_keys_file": str(tmp_path / "keys.yaml"), "cache_salt_secret_file": str(tmp_path / "secret")})
    pod = OBJECTS["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container["command"] == ["serve", "run", f"{mounts['config']}/serve_config.yaml"]
    assert app.args["api_keys_file"].startswith(mounts["access"] + "/")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == OBJECTS["ConfigMap"]["metadata"]["name"]
    assert volumes["access"]["secret"]["secretName"] == "serve-app-access"
    (model,) = app.args["llm_configs"]
    assert float(container["resources"]["requests"]["cpu"]) >= model["deployment_config"]["ray_actor_options"]["num_cpus"]


def test_keda_scales_the_deployment_on_the_queue_prometheus_scrapes() -> None:
    scaled = OBJECTS["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", OBJECTS["Deployment"]["metadata"]["name"])
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    assert re.findall(r"vllm:[a-z_]+", query) == ["vllm:num_requests_waiting"]
    assert "vllm:num_requests_waiting" in VLLM_DASHBOARD_SERIES | VLLM_MORE_SERIES  # served, as test_grafana checks
    (model,) = SERVE_CONFIG.applications[0].args["llm_configs"]
    assert f'model_name="{model["model_loading_config"]["model_id"]}"' in query
    monitor = OBJECTS["ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    service = OBJECTS["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"]["name"] == "serve-app-access"  # /metrics needs an admin key
