"""The Serve application's args, in Ray Serve LLM's shape (`llm_configs`) or the flat shorthand for one model:
validated with clear messages before anything is deployed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.app import build_app
from deployments.app_args import AppConfig

ROOT = Path(__file__).resolve().parents[2]


def _engines(args: dict) -> dict:
    """The engine deployments `build_app` binds, by model id."""
    return build_app(args)._bound_deployment.init_args[0]


def test_serve_config_yaml_is_a_serve_config_in_ray_serve_llms_shape() -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    config = AppConfig.from_args(app.args)
    (model,) = config.llm_configs
    assert model.model_id == "smollm2-135m-instruct" and model.engine().cache.kind == "paged"
    (engine,) = _engines(app.args).values()
    deployment = engine._bound_deployment
    assert deployment.name == "EngineDeployment:smollm2-135m-instruct"
    assert deployment._deployment_config.autoscaling_config.min_replicas == 1
    assert deployment._deployment_config.request_router_config.request_router_class.endswith("PrefixAwareRouter")


def test_each_model_is_an_engine_deployment_of_its_own_and_the_flat_args_are_one() -> None:
    engines = _engines({
        "llm_configs": [
            {"model_loading_config": {"model_id": "small", "model_source": "smollm2-135m-instruct"}},
            {
                "model_loading_config": {"model_id": "org/other.v2", "model_source": "smollm2-135m-instruct"},
                "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
                "lora_config": {"dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 3},
            },
        ],
        "max_request_bytes": 65536,
    })
    assert [e._bound_deployment.name for e in engines.values()] == [
        "EngineDeployment:small", "EngineDeployment:org--other_v2"
    ]
    assert engines["org/other.v2"]._bound_deployment._deployment_config.num_replicas == 2
    config = AppConfig.from_args({"model": "smollm2-135m-instruct", "served_model_name": "mine", "cache_tokens": 64})
    (model,) = config.llm_configs
    assert model.model_id == "mine" and model.engine().model.name == "smollm2-135m-instruct"
    assert model.engine().cache.num_tokens == 64


def test_lora_config_reaches_the_engine() -> None:
    config = AppConfig.from_args({"llm_configs": [{
        "model_loading_config": {"model_id": "m", "model_source": "smollm2-135m-instruct"},
        "lora_config": {"dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 3},
        "engine_kwargs": {"max_lora_rank": 8},
    }]})
    model = config.llm_configs[0].engine().model
    assert (str(model.dynamic_lora_loading_path), model.max_num_adapters_per_replica, model.max_lora_rank) == (
        "/adapters", 3, 8
    )


def _entry(**fields: object) -> dict:
    return {"llm_configs": [{"model_loading_config": {"model_id": "m"}, **fields}]}


@pytest.mark.parametrize(
    "args,needle",
    [
        ({"page_size": 0}, "page_size"),
        ({"kv_cache": "ring"}, "kind"),
        ({"cache_tokenz": 10}, "unknown key 'cache_tokenz' in the application args; known there: .*cache_tokens"),
        ({"served_model_nam": "m"}, "unknown key 'served_model_nam'.*served_model_name"),
        ({"llm_config": []}, "unknown key 'llm_config'.* known there: .*llm_configs"),
        ({"max_request_bytes": "lots"}, "max_request_bytes"),
        ({"model": "/no/such/folder"}, "neither an embedded model"),
        ({"llm_configs": []}, "llm_configs"),
        ({"llm_configs": [], "cache_tokens": 1}, "unknown key 'cache_tokens' in the application args; known there: llm_configs"),
        (_entry(engine_kwarg={}), "unknown key 'engine_kwarg' in an llm_configs entry; known there: deployment_config, "
         "engine_kwargs, lora_config, model_loading_config"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m", "source": "x"}}]},
         "unknown key 'source' in model_loading_config; known there: model_id, model_source"),
        (_entry(engine_kwargs={"max_num_seq": 1}), "unknown key 'max_num_seq' in engine_kwargs; known there: .*max_num_seqs"),
        (_entry(engine_kwargs={"model": "x"}), "engine_kwargs: 'model' goes in model_loading_config.model_source"),
        (_entry(deployment_config={"replicas": 2}), "unknown key 'replicas' in deployment_config; known there: .*num_replicas"),
        (_entry(lora_config={"path": "/a"}), "unknown key 'path' in lora_config; known there: dynamic_lora_loading_path"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "a:b"}}]}, "model_id 'a:b': no ':'"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m"}}] * 2}, "model_id 'm' is listed twice"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "a.b"}}, {"model_loading_config": {"model_id": "a_b"}}]},
         "model_ids 'a.b' and 'a_b' make one deployment name"),
        (_entry(engine_kwargs={"max_num_seqs": 600}), "max_num_batched_tokens must be >= scheduler.max_num_seqs"),
    ],
)
def test_bad_args_fail_with_a_message_naming_them(args: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_app(args)
