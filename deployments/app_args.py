"""The Serve application's args (`serve_config.yaml`), in Ray Serve LLM's shape: a list of `llm_configs` (each a
mapping or the path of a YAML file holding one), each an engine deployment of its own (`model_loading_config`,
`engine_kwargs`, `deployment_config`, `lora_config`, `runtime_env`, `accelerator_type`, `placement_group_config`,
`log_engine_metrics`), next to the server's options. The flat engine options of one model are shorthand for a
list of one. Every level refuses a key it does not know, naming it and the keys it knows, and a cloud URI (this
server reads models and adapters from local folders, the embedded package or the Hub), saying so."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve.deployment import Deployment

from serve_app.config import FLAT_OPTIONS, DEFAULT_MODEL, EngineConfig, ServerConfig

# Every engine deployment is named after its model, as Ray Serve LLM names its `LLMServer:<model_id>`.
ENGINE_DEPLOYMENT = "EngineDeployment"
# Engine options with a place of their own in an `llm_configs` entry, rather than in its `engine_kwargs`.
_PLACED_ELSEWHERE = {
    "model": "model_loading_config.model_source",
    "dynamic_lora_loading_path": "lora_config",
    "max_num_adapters_per_replica": "lora_config",
}
ENGINE_KWARGS = sorted(key for key in FLAT_OPTIONS if key not in _PLACED_ELSEWHERE)
# What an entry's `deployment_config` may set: the options of a Serve deployment, but its name.
DEPLOYMENT_OPTIONS = sorted(
    name for name in inspect.signature(Deployment.options).parameters
    if not name.startswith("_") and name not in ("self", "func_or_class", "name", "version")
)


# The URI schemes of Ray Serve LLM's cloud storage, which this server does not download from.
CLOUD_SCHEMES = ("s3://", "gs://", "abfss://", "azure://")


def refuse_cloud(value: Any, field: str) -> None:
    """ValueError where `value` is a cloud URI (or Ray Serve LLM's cloud mirror config)."""
    if isinstance(value, dict) or isinstance(value, str) and value.startswith(CLOUD_SCHEMES):
        shown = value.get("bucket_uri", value) if isinstance(value, dict) else value
        raise ValueError(
            f"{field}: {shown!r} is in cloud storage, which this server does not download from; copy it to a local "
            "folder on every node (or use a Hugging Face Hub id) and name that"
        )


def refuse_unknown(data: Any, known: list[str], where: str) -> None:
    """ValueError naming the first key of `data` not in `known`, and the keys known at `where`."""
    if isinstance(data, dict):
        unknown = [key for key in data if key not in known]
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in {where}; known there: {', '.join(known)}")


class _Listed(BaseModel):
    """A level of the args that names the keys it knows when it meets one it does not."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    where: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        refuse_unknown(data, sorted(cls.model_fields), cls.where)
        return data


class ModelLoadingConfig(_Listed):
    """The name clients send and where its weights come from."""

    where = "model_loading_config"

    model_id: str = Field(min_length=1, description="the `model` clients send; `<model_id>:<adapter>` names an adapter")
    model_source: str | dict[str, Any] | None = Field(
        None, description="an embedded model name, a local Hugging Face folder, a .gguf file or a Hub id; "
        "default: model_id"
    )
    tokenizer_source: None = Field(None, description="the tokenizer comes with the model (null only)")

    @field_validator("model_source", mode="before")
    @classmethod
    def _local(cls, value: Any) -> Any:
        refuse_cloud(value, "model_loading_config.model_source")
        return value

    @field_validator("model_id")
    @classmethod
    def _no_colon(cls, value: str) -> str:
        if ":" in value or value != value.strip():
            raise ValueError(f"model_id {value!r}: no ':' (it separates a model from its adapter) nor outer spaces")
        return value

    @property
    def source(self) -> str:
        return str(self.model_source or self.model_id)


class LoraConfig(_Listed):
    """Where a model's LoRA adapters are found (one PEFT folder per adapter name) and how many a replica holds."""

    where = "lora_config"

    dynamic_lora_loading_path: Path
    max_num_adapters_per_replica: int = Field(8, ge=1)

    @field_validator("dynamic_lora_loading_path", mode="before")
    @classmethod
    def _local(cls, value: Any) -> Any:
        refuse_cloud(value, "lora_config.dynamic_lora_loading_path")
        return value


class PlacementGroupConfig(_Listed):
    """Ray Serve LLM's `placement_group_config`: the engine replica's bundles (the engine runs in the replica, so
    the first bundle is the replica's own resources), as a list or one bundle per worker (one worker here)."""

    where = "placement_group_config"

    bundles: list[dict[str, float]] | None = Field(None, min_length=1)
    bundle_per_worker: dict[str, float] | None = None
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _one_form(self) -> PlacementGroupConfig:
        if (self.bundles is None) == (self.bundle_per_worker is None):
            raise ValueError("placement_group_config: give bundles or bundle_per_worker, one of them")
        return self

    def resolved(self, accelerator: str | None) -> list[dict[str, float]]:
        """The bundles, each with a share of `accelerator`'s resource where one is named (as Ray Serve LLM adds it)."""
        bundles = [dict(bundle) for bundle in self.bundles or [self.bundle_per_worker or {}]]
        if accelerator is not None:
            for bundle in bundles:
                bundle.setdefault(accelerator, 0.001)
        return bundles


# Ray Serve LLM's keys that this server has no use for, and why; each is refused by name.
RAY_LLM_REFUSED = {
    "accelerator_config": "hardware-specific engine settings are not supported; set engine_kwargs (device, ...)",
    "experimental_configs": "not supported",
    "server_cls": "not supported: the engine deployment is this server's",
    "callback_config": "not supported",
}

class LLMConfig(_Listed):
    """One model: an engine deployment of its own, with its own replicas, autoscaling and request router."""

    where = "an llm_configs entry"

    model_loading_config: ModelLoadingConfig
    llm_engine: Literal["vLLM"] = Field(
        "vLLM", description="Ray Serve LLM's one engine name: this server's engine runs, with vLLM's option names"
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="the engine options (serve_app.config)")
    deployment_config: dict[str, Any] = Field(
        default_factory=dict, description="the Serve options of its engine deployment (autoscaling_config, ...)"
    )
    lora_config: LoraConfig | None = None
    runtime_env: dict[str, Any] | None = Field(None, description="the engine replicas' Ray runtime_env")
    accelerator_type: str | None = Field(
        None, min_length=1, description="the accelerator its replicas need: Ray's `accelerator_type:<type>` resource"
    )
    placement_group_config: PlacementGroupConfig | None = None
    log_engine_metrics: bool = Field(True, description="engine replicas copy their state into Ray's metrics")

    @model_validator(mode="before")
    @classmethod
    def _ray_llm_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, reason in RAY_LLM_REFUSED.items():
                if data.get(key):
                    raise ValueError(f"{key}: {reason}")
            data = {key: value for key, value in data.items() if key not in RAY_LLM_REFUSED}
        return data

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in _PLACED_ELSEWHERE:
                raise ValueError(f"engine_kwargs: {key!r} goes in {_PLACED_ELSEWHERE[key]}")
        refuse_unknown(value, ENGINE_KWARGS, "engine_kwargs")
        return value

    @field_validator("deployment_config")
    @classmethod
    def _deployment_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        refuse_unknown(value, DEPLOYMENT_OPTIONS, "deployment_config")
        return value

    @model_validator(mode="after")
    def _placement_in_one_place(self) -> LLMConfig:
        placed = {"placement_group_bundles", "placement_group_strategy"} & set(self.deployment_config)
        if placed and self.placement_group_config is not None:
            raise ValueError(f"deployment_config.{sorted(placed)[0]}: give the placement in placement_group_config only")
        return self

    def serve_options(self) -> dict[str, Any]:
        """Its engine deployment's Serve options: `deployment_config`, with `runtime_env`, the accelerator's resource
        and `placement_group_config`'s bundles in the places Ray Serve LLM puts them."""
        options = copy.deepcopy(self.deployment_config)
        actor = options.get("ray_actor_options", {})
        if self.runtime_env:
            actor["runtime_env"] = {**actor.get("runtime_env", {}), **self.runtime_env}
        accelerator = f"accelerator_type:{self.accelerator_type}" if self.accelerator_type else None
        if accelerator is not None:
            actor["resources"] = {accelerator: 0.001, **actor.get("resources", {})}
        if self.placement_group_config is not None:
            bundles = self.placement_group_config.resolved(accelerator)
            actor.setdefault("num_cpus", bundles[0].get("CPU", 0))  # the replica is the first bundle's worker
            actor.setdefault("num_gpus", bundles[0].get("GPU", 0))
            options["placement_group_bundles"] = bundles
            options["placement_group_strategy"] = self.placement_group_config.strategy
        if actor:
            options["ray_actor_options"] = actor
        return options

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    @property
    def deployment_name(self) -> str:
        """Its engine deployment's name (`/` and `.` replaced, as Ray Serve LLM does)."""
        return f"{ENGINE_DEPLOYMENT}:{self.model_id.replace('/', '--').replace('.', '_')}"

    def engine(self) -> EngineConfig:
        lora = self.lora_config.model_dump() if self.lora_config is not None else {}
        return EngineConfig.from_options(model=self.model_loading_config.source, **self.engine_kwargs, **lora)


class AppConfig(BaseModel):
    """The application's args, validated: its models and the server's options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    llm_configs: list[LLMConfig] = Field(min_length=1)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _distinct_models(self) -> AppConfig:
        names: dict[str, str] = {}  # engine deployment name -> model id
        for llm in self.llm_configs:
            other = names.get(llm.deployment_name)
            if other == llm.model_id:
                raise ValueError(f"llm_configs: model_id {llm.model_id!r} is listed twice")
            if other is not None:
                raise ValueError(f"llm_configs: model_ids {other!r} and {llm.model_id!r} make one deployment name")
            names[llm.deployment_name] = llm.model_id
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """The config the args give: `llm_configs` plus server options, or the flat options of one model."""
        args = dict(args or {})
        server_keys = sorted(ServerConfig.model_fields)
        if "llm_configs" in args:
            refuse_unknown(args, ["llm_configs", *server_keys], "the application args")
            llms = [_entry(llm) for llm in args.pop("llm_configs")]
        else:
            flat = sorted([*FLAT_OPTIONS, "served_model_name"])
            refuse_unknown(args, ["llm_configs", *flat, *server_keys], "the application args")
            llms = [_one_model(args)]
        server = {key: args.pop(key) for key in list(args) if key in ServerConfig.model_fields}
        return cls(llm_configs=llms, server=ServerConfig(**server))

    def model(self, model_id: str) -> LLMConfig:
        return next(llm for llm in self.llm_configs if llm.model_id == model_id)


def _entry(llm: Any) -> Any:
    """An `llm_configs` entry, read from its YAML file where it is a path (as Ray Serve LLM reads them)."""
    if not isinstance(llm, (str, Path)):
        return llm
    path = Path(llm).expanduser()
    if not path.is_file():
        raise ValueError(f"llm_configs: {str(llm)!r} is not a file (an entry is a mapping or a YAML file's path)")
    entry = yaml.safe_load(path.read_text())
    if not isinstance(entry, dict):
        raise ValueError(f"llm_configs: {str(llm)!r} holds no mapping")
    return entry


def _one_model(args: dict[str, Any]) -> dict[str, Any]:
    """The `llm_configs` entry that the flat options of one model stand for (popped from `args`)."""
    source = args.pop("model", DEFAULT_MODEL)
    entry: dict[str, Any] = {
        "model_loading_config": {"model_id": args.pop("served_model_name", None) or source, "model_source": source},
        "engine_kwargs": {key: args.pop(key) for key in list(args) if key in ENGINE_KWARGS},
    }
    lora = {key: args.pop(key) for key in ("dynamic_lora_loading_path", "max_num_adapters_per_replica") if key in args}
    if lora:
        entry["lora_config"] = lora
    return entry
