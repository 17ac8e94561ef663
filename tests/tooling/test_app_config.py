"""The Serve application's args, in Ray Serve LLM's shape (`llm_configs`) or the flat shorthand for one model:
validated with clear messages before anything is deployed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.app import build_app
from deployments.app_args import AppConfig
from deployments.engine import EngineDeployment

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
        (_entry(engine_kwarg={}), "unknown key 'engine_kwarg' in an llm_configs entry; known there: accelerator_type, "
         "deployment_config, engine_kwargs, llm_engine, log_engine_metrics, lora_config, model_loading_config, "
         "placement_group_config, runtime_env"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m", "source": "x"}}]},
         "unknown key 'source' in model_loading_config; known there: model_id, model_source, tokenizer_source"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": "s3://bucket/qwen"}}]},
         "model_source: 's3://bucket/qwen' is in cloud storage, which this server does not download from"),
        ({"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "gs://b/q"}}}]},
         "'gs://b/q' is in cloud storage"),
        (_entry(lora_config={"dynamic_lora_loading_path": "s3://b/x"}), "dynamic_lora_loading_path: 's3://b/x' is in cloud"),
        (_entry(server_cls="my.Server"), "server_cls: not supported"),
        (_entry(llm_engine="SGLang"), "llm_engine"),
        (_entry(placement_group_config={"strategy": "PACK"}), "give bundles or bundle_per_worker"),
        (_entry(placement_group_config={"bundles": [{"CPU": 1}]}, deployment_config={"placement_group_strategy": "PACK"}),
         "placement_group_strategy: give the placement in placement_group_config only"),
        ({"llm_configs": ["/no/such/entry.yaml"]}, "'/no/such/entry.yaml' is not a file"),
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


# Two configs of Ray Serve LLM's docs (docs.ray.io, serve/llm: "Deploy with a config file" and the quickstart's
# builder example written as YAML), as a user copies them, with only import_path changed.
RAY_DOC_CONFIG = """
applications:
- args:
    llm_configs:
      - model_loading_config:
          model_id: qwen-0.5b
          model_source: Qwen/Qwen2.5-0.5B-Instruct
        accelerator_type: A10G
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
      - model_loading_config:
          model_id: qwen-1.5b
          model_source: Qwen/Qwen2.5-1.5B-Instruct
        accelerator_type: A10G
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
  import_path: deployments.app:build_app
  name: llm_app
  route_prefix: "/"
"""
RAY_DOC_FILE_CONFIG = """
applications:
- name: llm_app
  route_prefix: "/"
  import_path: deployments.app:build_app
  args:
    llm_configs:
        - {path}
"""
RAY_DOC_ENTRY = """
model_loading_config:
  model_id: my-llama
  model_source: unsloth/Meta-Llama-3.1-8B-Instruct
accelerator_type: L4
deployment_config:
  autoscaling_config:
    min_replicas: 1
    max_replicas: 2
engine_kwargs:
  max_model_len: 8192
runtime_env:
  env_vars:
    HF_HUB_OFFLINE: "1"
placement_group_config:
  bundle_per_worker: {{CPU: 2}}
  strategy: SPREAD
log_engine_metrics: false
"""


def test_ray_serve_llm_doc_configs_carry_over(tmp_path: Path) -> None:
    app = yaml.safe_load(RAY_DOC_CONFIG)["applications"][0]
    config = AppConfig.from_args(app["args"])
    assert [llm.model_id for llm in config.llm_configs] == ["qwen-0.5b", "qwen-1.5b"]
    options = config.llm_configs[0].serve_options()
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2}
    assert options["ray_actor_options"]["resources"] == {"accelerator_type:A10G": 0.001}  # Ray's accelerator resource
    entry = tmp_path / "my-llama.yaml"
    entry.write_text(RAY_DOC_ENTRY.format())
    app = yaml.safe_load(RAY_DOC_FILE_CONFIG.format(path=entry))["applications"][0]
    llm = AppConfig.from_args(app["args"]).llm_configs[0]  # an entry given as its YAML file's path
    assert llm.model_id == "my-llama" and llm.engine().model.max_model_len == 8192 and not llm.log_engine_metrics
    options = llm.serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 2, "accelerator_type:L4": 0.001}]
    assert options["placement_group_strategy"] == "SPREAD"
    actor = options["ray_actor_options"]
    assert actor["runtime_env"] == {"env_vars": {"HF_HUB_OFFLINE": "1"}} and (actor["num_cpus"], actor["num_gpus"]) == (2, 0)
    assert actor["resources"] == {"accelerator_type:L4": 0.001}
    EngineDeployment.options(name=llm.deployment_name, **options)  # Serve's own check: the replica fits its first bundle
