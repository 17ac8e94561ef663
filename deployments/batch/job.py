"""`serve-app batch`: a file of OpenAI batch lines answered on Ray Data by a pool of engine actors (one engine
each), with the model and options of an `llm_configs` entry of the same config `serve run` runs.

The lines are read through Ray Data (a local path or any filesystem pyarrow knows) and the ones the results
file already answers dropped; lines that share a prompt prefix are hash-partitioned into one block, and each
block goes whole to one actor, so its prefix is computed once, where it is cached. Results are appended to the
results file as the blocks finish: an interrupted run keeps them, and running it again does only the rest."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml
from ray.data._internal.planner.plan_udf_map_op import DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY as BATCHES_PER_CALL
from ray.util.placement_group import NODE_ID_LABEL_KEY

from deployments.app_args import AppConfig, LLMConfig
from deployments.batch.engine_actor import BatchEngine
from deployments.model_copy import check_model
from serve_app.batch.file_format import line_key, prefix_key
from serve_app.batch.results_file import ResultsFile
from serve_app.batch.summary import BatchSummary

logger = logging.getLogger(__name__)

# The application whose args hold the `llm_configs` (serve_config.yaml's `import_path`).
APP_IMPORT_PATH = "deployments.app:build_app"
# Lines per block at most (more blocks than this would need): a block's results reach the file when it is done.
ROWS_PER_BLOCK = 256
BLOCKS_PER_ACTOR = 8
# Lines each actor is given at once, in running tasks (max_num_seqs) at least this many times over: its engine
# always has lines waiting, so the continuous batch stays full while a block's last lines finish.
LINES_IN_FLIGHT_PER_RUNNING_TASK = 2
MAX_BLOCKS = 4096
# How long the engine actors may take to start (load, and compile on a configuration's first start) before
# any block is given out: all of them start first, so that the first one up does not take every block.
ACTORS_START_S = 900


@dataclass(frozen=True)
class BatchJob:
    input: str
    output: str
    config: Path = Path("serve_config.yaml")
    model: str | None = None  # the `llm_configs` entry's model_id; needed where the config has several
    concurrency: int | None = None  # engine actors; default: as many as the cluster's resources hold
    batch_size: int = 32  # lines an actor takes at once (several such batches run at once on each)


def read_config(path: Path, model: str | None) -> tuple[LLMConfig, AppConfig]:
    """The `llm_configs` entry of the Serve config at `path` that answers `model` (or its only one)."""
    serve_config = yaml.safe_load(Path(path).read_text())
    apps = [app for app in (serve_config or {}).get("applications", []) if app.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        raise ValueError(f"{path}: no application with import_path {APP_IMPORT_PATH}")
    config = AppConfig.from_args(apps[0].get("args"))
    ids = [llm.model_id for llm in config.llm_configs]
    if model is None:
        if len(ids) > 1:
            raise ValueError(f"{path} serves {', '.join(ids)}: name the batch's model with --model")
        return config.llm_configs[0], config
    if model not in ids:
        raise ValueError(f"--model {model!r} is not in {path}; its models: {', '.join(ids)}")
    return config.model(model), config


def actor_options(llm: LLMConfig) -> dict[str, Any]:
    """An engine actor's Ray options: the engine deployment's (`ray_actor_options`), less Serve's own."""
    actor = llm.serve_options().get("ray_actor_options", {})
    return {key: actor[key] for key in ("num_cpus", "num_gpus", "resources", "runtime_env", "memory") if key in actor}


def fitting_actors(options: dict[str, Any], cluster: dict[str, float]) -> int:
    """How many actors with `options` the cluster's resources hold (at least one)."""
    needs = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    counts = [math.floor(cluster.get(name, 0) / need) for name, need in needs.items() if need]
    return max(1, min(counts)) if counts else 1


def calls_per_actor(llm: LLMConfig, batch_size: int, lines_per_block: int) -> int:
    """Blocks each actor answers at once: Ray Data runs `BATCHES_PER_CALL` batches of a block at a time, and the
    engine should have `LINES_IN_FLIGHT_PER_RUNNING_TASK` times the tasks it runs at once given to it."""
    lines = LINES_IN_FLIGHT_PER_RUNNING_TASK * llm.engine().scheduler.max_num_seqs
    return max(1, math.ceil(lines / min(BATCHES_PER_CALL * batch_size, lines_per_block)))


def _keyed(batch: dict[str, np.ndarray], answered: frozenset[str]) -> dict[str, np.ndarray]:
    """The lines not answered yet, each with the key of the prompt prefix it shares."""
    texts = [str(text) for text in batch["text"]]
    todo = [text for text in texts if line_key(text) not in answered]
    return {"text": np.array(todo, dtype=object), "prefix": np.array([prefix_key(t) for t in todo], dtype=object)}


def _read_lines(path: str) -> ray.data.Dataset:
    """The input's lines: a local path read on this node (where it is), a URI wherever Ray Data reads it."""
    if "://" in path:
        return ray.data.read_text(path, num_cpus=0)
    this_node = {NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()}
    return ray.data.read_text(str(Path(path).resolve()), num_cpus=0, label_selector=this_node)


def run_batch(job: BatchJob, address: str | None = None) -> BatchSummary:
    """Answer every line of `job.input` not yet in `job.output`, appending the results there; on the Ray cluster
    at `address` (None: $RAY_ADDRESS, else the one `ray start` started here, else a new one; `local`: a new one)."""
    llm, config = read_config(job.config, job.model)
    ray.init(address=address)
    check_model(llm.model_loading_config.source)
    started = time.monotonic()
    results = ResultsFile(job.output)
    answered = frozenset(results.open())
    summary = BatchSummary(already_answered=len(answered))
    ray.data.DataContext.get_current().wait_for_min_actors_s = ACTORS_START_S  # before any dataset copies it
    try:
        lines = _read_lines(job.input)
        todo = lines.map_batches(_keyed, fn_kwargs={"answered": answered}, num_cpus=0, batch_format="numpy").materialize()
        count = todo.count()
        if count:
            options = actor_options(llm)
            actors = job.concurrency or fitting_actors(options, ray.cluster_resources())
            blocks = min(max(actors * BLOCKS_PER_ACTOR, math.ceil(count / ROWS_PER_BLOCK)), MAX_BLOCKS)
            calls = calls_per_actor(llm, job.batch_size, math.ceil(count / blocks))
            # Materialized before the engines start: the shuffle's tasks need CPUs the actors would hold.
            grouped = todo.repartition(blocks, keys=["prefix"]).materialize()
            answers = grouped.map_batches(
                BatchEngine,
                fn_constructor_kwargs={
                    "llm": llm.model_dump(mode="json", exclude_defaults=True),
                    "server": config.server.model_dump(mode="json", exclude_defaults=True),
                },
                compute=ray.data.ActorPoolStrategy(
                    size=actors, max_concurrent_calls_per_actor=calls, max_tasks_in_flight_per_actor=calls
                ),
                batch_size=job.batch_size,
                batch_format="numpy",
                **options,
            )
            for batch in answers.iter_batches(batch_size=None, batch_format="numpy"):
                results.write([str(result) for result in batch["result"]])
                for failed, prompt, completion in zip(batch["failed"], batch["prompt_tokens"], batch["completion_tokens"]):
                    summary.count(bool(failed), int(prompt), int(completion))
    finally:
        results.close()
        summary.seconds = time.monotonic() - started
    return summary
