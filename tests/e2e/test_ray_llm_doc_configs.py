"""Ray Serve LLM's own example configs, deployed as a user copies them with only `import_path` changed: plain
`serve run` of the docs' two-model config (`accelerator_type: A10G`), and of a config whose `llm_configs` entry is a
YAML file (`accelerator_type: L4`, `runtime_env`, `placement_group_config`, `log_engine_metrics`).

What this machine cannot have is stood in for, and only that: the Hub models (no network) are tiny random models
prepared under their Hub ids in a model cache of the test's own (`SERVE_APP_CACHE_DIR`), as a node that fetched them
once holds them; the GPUs are Ray's accelerator resources, given to the cluster `serve run` starts through Ray's
`RAY_OVERRIDE_RESOURCES` (a node with those GPUs has them by itself). The engines run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from serve_app.bench.servers import ServeRun
from serve_app.model.loader import prepare_once
from tests.inprocess import openai_client
from tests.tiny_models import build_tiny_model
from tests.tooling.test_app_config import RAY_DOC_CONFIG, RAY_DOC_ENTRY, RAY_DOC_FILE_CONFIG


def _stand_in(cache: Path, repo_id: str, model_path: Path) -> None:
    """A tiny model prepared in `cache` as the Hub model `repo_id` is once fetched (its context as long as the
    configs ask)."""
    target = cache / "models" / "hub" / repo_id.replace("/", "--")
    prepare_once(target, repo_id, lambda staging: build_tiny_model("qwen3", staging, model_path, max_position_embeddings=8192))


def _deploy(workdir: Path, config: str, resources: dict[str, float], model_path: Path) -> list[str]:
    """`serve run` on `config`; the answers of each model it serves, by id."""
    cache = workdir / "cache"
    for entry in yaml.safe_load(config)["applications"][0]["args"]["llm_configs"]:
        loading = entry["model_loading_config"] if isinstance(entry, dict) else yaml.safe_load(Path(entry).read_text())["model_loading_config"]
        _stand_in(cache, loading["model_source"], model_path)
    path = workdir / "config.yaml"
    path.write_text(config)
    env = {"SERVE_APP_CACHE_DIR": str(cache), "RAY_OVERRIDE_RESOURCES": json.dumps(resources)}
    run = ServeRun(workdir, config_path=path, plain=True, env=env, timeout=300)
    try:
        client = openai_client(run.url)
        served = sorted(model.id for model in client.models.list())
        for model in served:
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            assert answer.choices[0].message.content is not None and answer.usage.completion_tokens >= 1
        return served
    finally:
        run.stop()


def test_the_docs_two_model_config_deploys(tmp_path: Path, model_path: Path) -> None:
    assert _deploy(tmp_path, RAY_DOC_CONFIG, {"accelerator_type:A10G": 1}, model_path) == ["qwen-0.5b", "qwen-1.5b"]


def test_a_config_with_an_entry_file_deploys(tmp_path: Path, model_path: Path) -> None:
    entry = tmp_path / "my-llama.yaml"
    entry.write_text(RAY_DOC_ENTRY.format())
    config = RAY_DOC_FILE_CONFIG.format(path=entry)
    assert _deploy(tmp_path, config, {"accelerator_type:L4": 1}, model_path) == ["my-llama"]
