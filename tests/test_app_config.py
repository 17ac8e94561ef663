"""The Serve application's args: validated with clear messages before anything is deployed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.app import build_app
from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent


def test_serve_config_yaml_is_a_serve_config_whose_args_validate() -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    engine = next(d for d in app.deployments if d.name == "EngineDeployment")
    assert engine.autoscaling_config["min_replicas"] == 1
    config = AppConfig.from_args(app.args)
    assert config.engine.cache.kind == "paged" and config.served_model_name == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    "args,needle",
    [
        ({"page_size": 0}, "page_size"),
        ({"kv_cache": "ring"}, "kind"),
        ({"cache_tokenz": 10}, "unknown application arg 'cache_tokenz'; engine options: .*cache_tokens"),
        ({"served_model_nam": "m"}, "unknown application arg 'served_model_nam'.* server options: .*served_model_name"),
        ({"max_request_bytes": "lots"}, "max_request_bytes"),
        ({"model": "/no/such/folder"}, "neither an embedded model"),
    ],
)
def test_bad_args_fail_with_a_message_naming_them(args: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_app(args)
