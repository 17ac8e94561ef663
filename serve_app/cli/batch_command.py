"""`serve-app batch -i requests.jsonl -o results.jsonl`: a file of OpenAI batch lines answered on a Ray cluster
(`deployments.batch.job`, the Ray layer, imported only when the command runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_batch(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser(
        "batch", help="answer a file of OpenAI batch requests on Ray Data; run it again to resume",
    )
    batch.add_argument("-i", "--input", required=True, help="the requests: OpenAI's batch file format (a path or URI)")
    batch.add_argument(
        "-o", "--output", required=True,
        help="the results, a line per request (a path or URI); where it exists, only the requests it lacks run",
    )
    batch.add_argument("--config", type=Path, default=Path("serve_config.yaml"), help="the Serve config whose llm_configs to use")
    batch.add_argument("--model", default=None, help="the llm_configs entry's model_id (where the config has several)")
    batch.add_argument(
        "--concurrency", type=int, default=None,
        help="engine actors (default: as many as the cluster's CPUs or GPUs hold, by the entry's ray_actor_options)",
    )
    batch.add_argument("--batch-size", type=int, default=32, help="requests an engine actor takes at once")
    batch.add_argument(
        "--address", default=None,
        help="the Ray cluster to run on (default: $RAY_ADDRESS, else the one `ray start` started here, else a new one)",
    )
    batch.set_defaults(func=_batch)


def _batch(args: argparse.Namespace) -> None:
    from deployments.batch.job import BatchJob, run_batch

    if args.concurrency is not None and args.concurrency < 1 or args.batch_size < 1:
        sys.exit("serve-app batch: --concurrency and --batch-size are at least 1")
    job = BatchJob(args.input, args.output, args.config, args.model, args.concurrency, args.batch_size)
    try:
        summary = run_batch(job, args.address)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"serve-app batch: {error}")
    print(summary.text())
