"""Ray Data LLM's processors against a running app: `ServeDeploymentProcessorConfig` calls the model's engine
deployment through Serve's handles (inside the cluster), `HttpRequestProcessorConfig` posts to the ingress's
OpenAI route (from anywhere). Run it on the app's cluster:

    serve run serve_config.yaml &        # or a cluster started first with `ray start`
    python examples/ray_data_llm.py      # prints one JSON line per answer
"""

from __future__ import annotations

import argparse
import json

import ray
from ray.data.llm import HttpRequestProcessorConfig, ServeDeploymentProcessorConfig, build_processor

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "How many legs has a spider?", "Say hello."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the llm_configs entry's model_id")
    parser.add_argument("--app", default="llm", help="the Serve application's name (serve_config.yaml's)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the ingress, for the HTTP processor")
    parser.add_argument("--api-key", default="unused", help="a tenant's API key, where the app has keys")
    parser.add_argument("--address", default=None, help="the Ray cluster (default: the one running here)")
    args = parser.parse_args()
    ray.init(address=args.address, logging_level="WARNING")
    questions = ray.data.from_items([{"question": question} for question in QUESTIONS])

    # The engine deployment, by name (`EngineDeployment:<model_id>`): method `chat` takes and returns OpenAI dicts.
    through_serve = build_processor(
        ServeDeploymentProcessorConfig(
            deployment_name=f"EngineDeployment:{args.model}", app_name=args.app, batch_size=8, concurrency=1,
        ),
        preprocess=lambda row: {
            "method": "chat",
            "request_kwargs": {
                "model": args.model, "messages": [{"role": "user", "content": row["question"]}],
                "max_tokens": 16, "temperature": 0,
            },
        },
        postprocess=lambda row: {"answer": row["choices"][0]["message"]["content"], "id": row["id"]},
    )
    # The ingress's OpenAI route, as any OpenAI client reaches it.
    through_http = build_processor(
        HttpRequestProcessorConfig(
            url=f"{args.url}/v1/chat/completions", headers={"Authorization": f"Bearer {args.api_key}"},
            batch_size=8, concurrency=1,
        ),
        preprocess=lambda row: {
            "payload": {
                "model": args.model, "messages": [{"role": "user", "content": row["question"]}],
                "max_tokens": 16, "temperature": 0,
            },
        },
        postprocess=lambda row: {
            "answer": row["http_response"]["choices"][0]["message"]["content"], "id": row["http_response"]["id"],
        },
    )
    for name, processor in (("serve_deployment", through_serve), ("http_request", through_http)):
        for row in processor(questions).take_all():
            print(json.dumps({"processor": name, "answer": row["answer"], "id": row["id"]}))


if __name__ == "__main__":
    main()
