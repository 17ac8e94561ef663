"""A local model (a Hugging Face folder or a .gguf file) named by an absolute path that this node lacks:
found on a node of the Ray cluster that has it and copied from there, through Ray's object store in
chunks, into this node's cache folder, once. A replica on a new node thus gets the model itself."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.model.loader import EMBEDDED_MODELS, ModelNotFoundError, model_source, prepare_once

# Serve writes this logger to the replica's log.
logger = logging.getLogger("ray.serve")

CHUNK_BYTES = 64 * 2**20


def model_here(name: str, cache_dir: Path) -> str:
    """The `model` option as this node can load it: `name` itself, unless it is an absolute path missing
    here; then the path of this node's copy of it, copied once from a node that has it."""
    path = _absent_local_path(name)
    if path is None:
        return name
    key = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    target = Path(cache_dir) / "models" / "copied" / f"{path.name}-{key}"

    def copy(staging: Path) -> None:
        owner = node_holding(path)
        if owner is None:
            raise ModelNotFoundError(f"model: {name} is on no node of the Ray cluster")
        logger.info("copying the model %s from node %s into %s (once)", path, owner, target)
        files = ray.get(_on(owner, _list_files).remote(str(path)))
        for relative in files:  # a file's relative path is "": staging / name / "" is staging / name
            (staging / path.name / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / path.name / relative).touch()
        for chunk in _on(owner, _read_files, num_returns="streaming").remote(str(path), files):
            relative, data = ray.get(chunk)
            with open(staging / path.name / relative, "ab") as out:
                out.write(data)

    return str(prepare_once(target, str(path), copy) / path.name)


def check_model(name: str) -> None:
    """Refuse a `model` option that names nothing loadable: an absolute path counts where any node of the
    cluster has it (its replicas elsewhere copy it), anything else as `model_source` judges it here."""
    path = _absent_local_path(name)
    if path is None or node_holding(path) is None:
        model_source(name)


def _absent_local_path(name: str) -> Path | None:
    """`name` as an absolute path this node lacks; None for anything else (a model here, a name, a Hub id)."""
    path = Path(name).expanduser()
    return None if name in EMBEDDED_MODELS or not path.is_absolute() or path.exists() else path


def node_holding(path: Path) -> str | None:
    """A live node of the cluster whose filesystem has `path` (None where Ray runs no cluster)."""
    if not ray.is_initialized():
        return None
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    found = ray.get([_on(node, _exists).remote(str(path)) for node in nodes])
    return next((node for node, present in zip(nodes, found) if present), None)


def _on(node_id: str, task, **options):
    """`task` pinned to the node `node_id`, taking no CPU, with these further options."""
    return task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)


@ray.remote
def _exists(path: str) -> bool:
    return Path(path).exists()


@ray.remote
def _list_files(path: str) -> list[str]:
    """The files to copy, relative to the folder `path` (a file: [""])."""
    root = Path(path)
    if root.is_file():
        return [""]
    return sorted(str(file.relative_to(root)) for file in root.rglob("*") if file.is_file())


@ray.remote
def _read_files(path: str, files: list[str]) -> Iterator[tuple[str, bytes]]:
    """(relative path, the next chunk of it), file after file."""
    for relative in files:
        with open(Path(path) / relative, "rb") as source:
            while chunk := source.read(CHUNK_BYTES):
                yield relative, chunk
