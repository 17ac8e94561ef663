"""BatchEngine: a Ray Data actor holding one engine (in its own process, as an engine replica holds it), which
answers the batch lines of each block it is given, all of a block's lines at once into the engine's continuous
batch. An engine that dies takes its actor down with it, so that Ray restarts the actor and runs its block
again: a result leaves an actor only whole, so no line is answered twice and none is lost."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np

from deployments.app_args import LLMConfig
from deployments.model_copy import model_here
from deployments.placement import Placement
from serve_app.batch.answering import BatchAnswerer
from serve_app.config import ServerConfig
from serve_app.engine.process import EngineProcess
from serve_app.http.engine_client import LocalEngineClient, model_card
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.served_models import ServedModels

logger = logging.getLogger(__name__)


class BatchEngine:
    def __init__(self, llm: dict[str, Any], server: dict[str, Any]) -> None:
        llm_config = LLMConfig.model_validate(llm)
        config = llm_config.engine()
        model = config.model
        self.engine = EngineProcess(
            Placement.of_this_actor().apply(config.with_options(model=model_here(model.name, model.cache_dir))),
            child="deployments.engine_child",
        )
        client = LocalEngineClient(self.engine, model_card(self.engine, llm_config.model_id, config.grammar))
        limits = RequestLimits.from_config(ServerConfig.model_validate(server))
        self.answerer = BatchAnswerer(ServedModels({llm_config.model_id: client}), limits)

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The result lines of a batch of request lines (column `text`)."""
        answered = await asyncio.gather(*(self.answerer.answer(str(text)) for text in batch["text"]))
        if not self.engine.alive:  # its answers are the engine's failure, not the lines': run them again elsewhere
            logger.error("the engine process has exited: this actor exits for Ray to restart it and retry its lines")
            os._exit(1)
        return {
            "key": np.array([a.key for a in answered], dtype=object),
            "result": np.array([a.result for a in answered], dtype=object),
            "failed": np.array([a.failed for a in answered], dtype=bool),
            "prompt_tokens": np.array([a.prompt_tokens for a in answered], dtype=np.int64),
            "completion_tokens": np.array([a.completion_tokens for a in answered], dtype=np.int64),
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
