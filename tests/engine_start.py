"""One engine start in a fresh process, as a replica's is: `python -m tests.engine_start CONFIG_JSON PROMPT_JSON`
builds an `InferenceEngine` from an `EngineConfig` dumped as JSON, decodes the prompt (token ids) greedily
for 8 tokens, and prints its stats and tokens as one JSON line."""

from __future__ import annotations

import json
import sys

from serve_app import GenerateRequest, InferenceEngine
from serve_app.config import EngineConfig


def main(config_json: str, prompt_json: str) -> None:
    engine = InferenceEngine(config=EngineConfig.model_validate_json(config_json))
    try:
        result = engine.submit(GenerateRequest(prompt=json.loads(prompt_json), max_tokens=8, temperature=0, ignore_eos=True))
        tokens = list(result.wait(120).token_ids)
        print(json.dumps({"stats": engine.get_stats(), "tokens": tokens}))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
