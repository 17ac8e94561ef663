"""An engine replica runs where Ray placed it: on a GPU only when Ray gave it one, with as many CPU
threads as the CPUs Ray reserved for it, unless the config says otherwise."""

from __future__ import annotations

import logging

import pytest
import torch

from deployments.placement import Placement
from serve_app.config import EngineConfig
from serve_app.model.runner import resolve_device


@pytest.fixture
def torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose GPU torch can see (Ray 2.60 no longer hides it from a replica with `num_gpus: 0`)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_no_gpu_from_ray_means_the_cpu_even_where_torch_sees_one(torch_sees_a_gpu, caplog) -> None:
    assert resolve_device("auto").type == "cuda"  # what `auto` alone would pick on this node
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        placed = Placement(gpu_ids=[], cpus=2.0).apply(EngineConfig.from_options(device="auto"))
    assert placed.model.device == "cpu" and resolve_device(placed.model.device).type == "cpu"
    assert placed.model.num_threads == 2
    assert "runs on the CPU" in caplog.text


def test_a_gpu_from_ray_means_cuda(torch_sees_a_gpu) -> None:
    placed = Placement(gpu_ids=["0"], cpus=1.0).apply(EngineConfig.from_options(device="auto"))
    assert placed.model.device == "cuda" and placed.model.num_threads == 1


@pytest.mark.parametrize("cpus,threads", [(0.0, 1), (0.5, 1), (1.0, 1), (3.7, 3), (8.0, 8)])
def test_threads_follow_the_cpus_ray_reserved(cpus: float, threads: int) -> None:
    assert Placement(gpu_ids=[], cpus=cpus).apply(EngineConfig.from_options(device="auto")).model.num_threads == threads


def test_what_the_config_names_stays(torch_sees_a_gpu) -> None:
    config = EngineConfig.from_options(device="cuda", num_threads=6)
    assert Placement(gpu_ids=[], cpus=1.0).apply(config) == config
    assert Placement(gpu_ids=["0"], cpus=4.0).apply(EngineConfig.from_options(device="cpu")).model.device == "cpu"
