"""The `serve-app` console script: `serve` (the app, as `serve run` runs it), `prepare-model` and the `bench`
commands."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from serve_app.config import DEFAULT_MODEL, default_cache_dir


def _prepare_model(args: argparse.Namespace) -> None:
    from serve_app.model.loader import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(args.model, args.cache_dir)
    except ModelNotFoundError as exc:
        sys.exit(f"serve-app: {exc}")
    print(path)


def _serve(args: argparse.Namespace) -> None:
    """Serve's own `serve run CONFIG` (the command the README gives), in place of this process: the `serve`
    script installed beside this Python."""
    beside = Path(sys.executable).with_name("serve")
    serve = str(beside) if beside.exists() else shutil.which("serve")
    if serve is None:
        sys.exit("serve-app: Ray Serve's `serve` command is not installed (pip install 'ray[serve]')")
    address = ["--address", args.address] if args.address else []
    os.execv(serve, [serve, "run", *address, str(args.config)])


def _bench_engine(args: argparse.Namespace) -> None:
    from serve_app.bench.engine_bench import main

    main(args)


def _bench_compare(args: argparse.Namespace) -> None:
    from serve_app.bench.compare import main

    main(args)


def _bench_serve(args: argparse.Namespace) -> None:
    from serve_app.bench.serve_bench import main

    main(args)


def _bench_tiers(args: argparse.Namespace) -> None:
    from serve_app.bench.tiers_bench import main

    main(args)


def _bench_prefix(args: argparse.Namespace) -> None:
    from serve_app.bench.prefix_bench import main

    main(args)


def _bench_spec(args: argparse.Namespace) -> None:
    from serve_app.bench.spec_bench import main

    main(args)


def _bench_soak(args: argparse.Namespace) -> None:
    from serve_app.bench.soak import main

    main(args)


def _bench_start(args: argparse.Namespace) -> None:
    from serve_app.bench.start_bench import main

    main(args)


def _bench_process_cpu(args: argparse.Namespace) -> None:
    from serve_app.bench.process_cpu import main

    main(args)


def _bench_decode_kernel(args: argparse.Namespace) -> None:
    from serve_app.bench.decode_kernel_bench import main

    main(args)


def _bench_structured(args: argparse.Namespace) -> None:
    from serve_app.bench.structured_bench import main

    main(args)


def _bench_lora(args: argparse.Namespace) -> None:
    from serve_app.bench.lora_bench import main

    main(args)


def _bench_clients(args: argparse.Namespace) -> None:
    from serve_app.bench.clients_bench import Server, run

    servers = [Server(*spec.split("=", 2)) for spec in args.server]
    print(run(servers))


def _bench_quant(args: argparse.Namespace) -> None:
    from serve_app.bench.quant_bench import main

    main(args)


def _bench_gpu_check(args: argparse.Namespace) -> None:
    from serve_app.bench.gpu_check import main

    main(args)


def _bench_route(args: argparse.Namespace) -> None:
    if args.simulate:
        from serve_app.bench.route_sim import main
    else:
        from serve_app.bench.route_bench import main

    main(args)


def _str_list(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _quantization_list(text: str) -> list[str]:
    kinds = _str_list(text)
    if not kinds or any(kind not in ("int8", "fp8") for kind in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: int8, fp8 or both, comma-separated")
    return kinds


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's help followed by its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default == argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """A parser whose help shows defaults; the options that several commands share get their one help text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        for action in self._actions:
            if action.help is None and action.dest in _SHARED_HELP:
                action.help = _SHARED_HELP[action.dest]
        return super().format_help()


# The help of the options several commands share: one name, one meaning.
_SHARED_HELP = {
    "model": "the model: an embedded model name or a local Hugging Face folder",
    "json": "also write the report to this JSON file",
    "seed": "seed of the prompt set",
    "max_tokens": "new tokens per request",
    "requests": "number of requests",
    "concurrency": "requests in flight; a comma list sweeps, e.g. 1,8,32",
    "device": "where it runs: cpu, cuda, cuda:N",
    "quantization": "the model's weights: none or int8",
    "page_size": "tokens per KV page",
    "rounds": "rounds to repeat (alternating where it compares)",
    "conversations": "conversations",
    "turns": "turns per conversation",
    "max_model_len": "context limit per request",
    "cache_tokens": "the KV cache's size, in tokens",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="serve-app", description="An LLM inference server and its tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the app: `serve run CONFIG`, as the README says")
    serve.add_argument("config", nargs="?", default="serve_config.yaml", help="the Serve config (default: %(default)s)")
    serve.add_argument(
        "--address", default=None,
        help="the Ray cluster to run on (default: $RAY_ADDRESS, else the one `ray start` started here, else a new one)",
    )
    serve.set_defaults(func=_serve)

    prepare = commands.add_parser("prepare-model", help="make a model ready to load (the embedded one is converted once)")
    prepare.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="an embedded model name or a local folder")
    prepare.add_argument("--cache-dir", default=default_cache_dir(), help="where prepared models are kept")
    prepare.set_defaults(func=_prepare_model)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    engine = bench.add_parser("engine", help="the in-process engine: throughput, TTFT and TPOT")
    engine.add_argument("--model", default=DEFAULT_MODEL)
    engine.add_argument("--kv-cache", default="paged", choices=["paged", "contiguous"], help="the KV cache: paged (pages shared by prefix) or contiguous (a slot per request)")
    engine.add_argument("--requests", type=int, default=64)
    engine.add_argument("--concurrency", type=_int_list, default=[16], help="requests in flight; a list sweeps: 1,8,32")
    engine.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    engine.add_argument("--seed", type=int, default=0, help="seed of the prompt set")
    engine.add_argument("--json", default=None, help="also write the rows to this JSON file")
    engine.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the engine's compiled forward"
    )
    engine.set_defaults(func=_bench_engine)

    compare = bench.add_parser("compare", help="this engine and server against transformers, side by side")
    compare.add_argument("--model", default=DEFAULT_MODEL)
    compare.add_argument("--requests", type=int, default=128)
    compare.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    compare.add_argument(
        "--concurrency", type=_int_list, default=[1, 16, 64, 128], help="requests in flight for engine and http; a list sweeps"
    )
    compare.add_argument(
        "--systems", type=_str_list, default=None,
        help="comma list of engine,hf-sequential,hf-static,hf-generate-batch,http,http-int8,http-eager,"
        "http-int8-eager,llama-server",
    )
    compare.add_argument(
        "--workloads", type=_str_list, default=["completions", "chat"],
        help="what the HTTP systems and llama-server run: completions (token-id prompts), chat (short chats "
        "through each server's chat template), or both",
    )
    compare.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: adds that system")
    compare.add_argument("--gguf", action="append", default=[], help="a GGUF for llama-server (repeat for several)")
    compare.add_argument("--device", default="cpu", help="where the in-process systems run: cpu, cuda, cuda:N")
    compare.add_argument("--dtype", default="float32", help="their dtype: float32, bfloat16, float16")
    compare.add_argument("--sequential-requests", type=int, default=8, help="requests for one-at-a-time generate (it is slow)")
    compare.add_argument("--single-client-requests", type=int, default=16, help="requests at concurrency 1 (it is slow)")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--json", default=None, help="write the report here")
    compare.add_argument("--plot", default=None, help="write a PNG plot here")
    compare.set_defaults(func=_bench_compare)

    serve = bench.add_parser("serve", help="load a running server: a concurrency sweep or a Poisson request rate")
    serve.add_argument("--url", default="http://127.0.0.1:8000", help="the server's URL, without /v1")
    serve.add_argument("--model", default=None, help="the served model name (asked from /v1/models by default)")
    serve.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], help="requests in flight; a list sweeps")
    serve.add_argument("--rate", type=float, default=None, help="requests per second (Poisson) instead of a sweep")
    serve.add_argument("--requests", type=int, default=64, help="stop after this many requests")
    serve.add_argument("--duration", type=float, default=120.0, help="stop issuing after this many seconds")
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--json", default=None)
    serve.set_defaults(func=_bench_serve)

    prefix = bench.add_parser("prefix", help="a shared long system prompt: cold then warm, prefix caching on and off")
    prefix.add_argument("--model", default=DEFAULT_MODEL)
    prefix.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    prefix.add_argument("--warm-requests", type=int, default=6, help="requests that reuse the cached system prompt")
    prefix.add_argument("--max-tokens", type=int, default=16)
    prefix.add_argument("--seed", type=int, default=0)
    prefix.add_argument("--json", default=None)
    prefix.set_defaults(func=_bench_prefix)

    tiers = bench.add_parser("tiers", help="TTFT of a long prefix recomputed and from each KV tier; conversations "
                             "overflowing the pool, tiers on and off (a two-raylet Ray cluster on this host)")
    tiers.add_argument("--model", default=DEFAULT_MODEL)
    tiers.add_argument("--prefix-tokens", type=int, default=3000, help="length of each shared document")
    tiers.add_argument("--documents", type=int, default=3, help="documents per case (TTFT p50 over them)")
    tiers.add_argument("--conversations", type=int, default=4)
    tiers.add_argument("--turns", type=int, default=4)
    tiers.add_argument("--system-tokens", type=int, default=1500, help="each conversation's system prompt")
    tiers.add_argument("--pool-tokens", type=int, default=4096, help="the pool of the conversations' engines")
    tiers.add_argument("--max-tokens", type=int, default=16)
    tiers.add_argument("--json", default=None)
    tiers.set_defaults(func=_bench_tiers)

    spec = bench.add_parser("spec", help="n-gram speculative decoding against none, side by side: one client on "
                            "input-grounded chats, then many on the standard chat prompts")
    spec.add_argument("--model", default=DEFAULT_MODEL)
    spec.add_argument("--grounded-requests", type=int, default=16, help="chats that copy, quote or edit their input")
    spec.add_argument("--grounded-max-tokens", type=int, default=128, help="new tokens per grounded chat")
    spec.add_argument("--chat-requests", type=int, default=128, help="standard chats")
    spec.add_argument("--chat-max-tokens", type=int, default=64, help="new tokens per standard chat")
    spec.add_argument(
        "--concurrency", type=_int_list, default=[64], help="requests in flight on the standard chats; a comma list sweeps"
    )
    spec.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per step")
    spec.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram matched in the context")
    spec.add_argument("--prompt-lookup-max", type=int, default=5, help="longest n-gram matched in the context")
    spec.add_argument("--json", default=None)
    spec.set_defaults(func=_bench_spec)

    soak = bench.add_parser("soak", help="many streaming clients (some hanging up, some malformed) against serve run")
    soak.add_argument("--model", default=DEFAULT_MODEL)
    soak.add_argument(
        "--concurrency", type=int, default=48, help="streaming clients at once (one number: the rounds compare memory at one load)"
    )
    soak.add_argument("--duration", type=float, default=120.0, help="seconds per round")
    soak.add_argument("--rounds", type=int, default=3)
    soak.add_argument("--max-tokens", type=int, default=32)
    soak.add_argument("--deadline", type=float, default=120.0, help="a request taking longer is a hang")
    soak.add_argument("--max-growth-mb", type=float, default=200.0, help="allowed memory growth after the first round")
    soak.add_argument("--json", default=None)
    soak.set_defaults(func=_bench_soak)

    start = bench.add_parser(
        "start", help="serve run to its first answer: eager, compiled with an empty compile cache, then with a warm one"
    )
    start.add_argument("--model", default=DEFAULT_MODEL)
    start.add_argument("--rounds", type=int, default=2, help="eager and warm compiled starts, alternating, after the cold one")
    start.add_argument("--json", default=None)
    start.set_defaults(func=_bench_start)

    process_cpu = bench.add_parser(
        "process-cpu", help="streaming clients against serve run: CPU each process spends per generated token"
    )
    process_cpu.add_argument("--model", default=DEFAULT_MODEL)
    process_cpu.add_argument("--requests", type=int, default=4)
    process_cpu.add_argument("--concurrency", type=_int_list, default=[1])
    process_cpu.add_argument("--max-tokens", type=int, default=64)
    process_cpu.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the engine's compiled forward"
    )
    process_cpu.add_argument("--quantization", default="none", choices=["none", "int8"])
    process_cpu.add_argument("--json", default=None)
    process_cpu.set_defaults(func=_bench_process_cpu)

    kernel = bench.add_parser(
        "decode-kernel", help="the paged decode-attention kernel on one layer's call, caches warm and cold"
    )
    kernel.add_argument(
        "--model", default=None, help="take the heads, key/value heads and head dimension from this model's config"
    )
    kernel.add_argument("--rows", type=int, default=64, help="decode rows (requests) in the call")
    kernel.add_argument("--heads", type=int, default=9, help="query heads")
    kernel.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    kernel.add_argument("--head-dim", type=int, default=64, help="dimension of a head")
    kernel.add_argument("--page-size", type=int, default=16)
    kernel.add_argument("--context", type=int, default=50, help="tokens each row attends to")
    kernel.add_argument("--threads", type=int, default=2, help="CPU threads")
    kernel.add_argument("--calls", type=int, default=100, help="calls timed per round")
    kernel.add_argument("--rounds", type=int, default=2)
    kernel.add_argument("--against", default=None, help="another paged_decode.c to time alongside")
    kernel.add_argument("--json", default=None)
    kernel.set_defaults(func=_bench_decode_kernel)

    structured = bench.add_parser("structured", help="the same requests with and without a JSON schema, in one run")
    structured.add_argument("--model", default=DEFAULT_MODEL)
    structured.add_argument("--requests", type=int, default=64)
    structured.add_argument("--concurrency", type=_int_list, default=[64])
    structured.add_argument("--max-tokens", type=int, default=64)
    structured.add_argument("--repeats", type=int, default=2, help="alternating pairs of runs")
    structured.add_argument("--seed", type=int, default=0)
    structured.add_argument("--json", default=None)
    structured.set_defaults(func=_bench_structured)

    lora = bench.add_parser("lora", help="the base model alone against the base and LoRA adapters in even shares")
    lora.add_argument("--model", default=DEFAULT_MODEL)
    lora.add_argument("--adapters", type=int, default=4, help="LoRA adapters, written at random and served in even shares with the base")
    lora.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    lora.add_argument("--requests", type=int, default=128)
    lora.add_argument("--concurrency", type=_int_list, default=[64])
    lora.add_argument("--max-tokens", type=int, default=64)
    lora.add_argument("--repeats", type=int, default=2, help="alternating pairs of runs")
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the engine's compiled forward"
    )
    lora.add_argument("--quantization", default="none", choices=["none", "int8"])
    lora.add_argument("--json", default=None)
    lora.set_defaults(func=_bench_lora)

    clients = bench.add_parser(
        "clients", help="client libraries' structured-output and tool cases against running servers, side by side"
    )
    clients.add_argument(
        "--server", action="append", required=True, metavar="NAME=URL=MODEL",
        help="a server to run every case against (repeat it): its column name, its URL without /v1, the model it serves",
    )
    clients.set_defaults(func=_bench_clients)

    quant = bench.add_parser(
        "quant", help="quantized weights against the unquantized model: greedy agreement, log-prob gap, tok/s"
    )
    quant.add_argument("--model", default=DEFAULT_MODEL)
    quant.add_argument("--quantization", type=_quantization_list, default=["int8"], help="the quantized weights to measure: int8, fp8 or int8,fp8")
    quant.add_argument("--device", default="cpu")
    quant.add_argument("--dtype", default="float32", help="the unquantized model's dtype and the activations'")
    quant.add_argument("--requests", type=int, default=64)
    quant.add_argument("--max-tokens", type=int, default=64)
    quant.add_argument("--concurrency", type=_int_list, default=[1, 64])
    quant.add_argument("--cache-tokens", type=int, default=16384)
    quant.add_argument("--seed", type=int, default=0)
    quant.add_argument("--json", default=None)
    quant.set_defaults(func=_bench_quant)
    gpu = bench.add_parser(
        "gpu-check", help="on an accelerator: the greedy oracle per dtype, bench compare, then int8 and fp8 weights there"
    )
    gpu.add_argument("--model", default=DEFAULT_MODEL)
    gpu.add_argument("--device", default="cuda")
    gpu.add_argument("--dtypes", type=_str_list, default=["float32", "bfloat16"], help="the oracle's dtypes")
    gpu.add_argument("--oracle-requests", type=int, default=16, help="requests of the greedy oracle")
    gpu.add_argument("--oracle-max-tokens", type=int, default=32, help="new tokens per oracle request")
    gpu.add_argument("--bench-requests", type=int, default=256, help="requests of bench compare")
    gpu.add_argument("--bench-max-tokens", type=int, default=64, help="new tokens per request in bench compare")
    gpu.add_argument("--bench-dtype", default="bfloat16", help="the dtype of bench compare's in-process systems")
    gpu.add_argument("--concurrency", type=_int_list, default=[1, 64, 256])
    gpu.add_argument(
        "--quantization", type=_quantization_list, default=["int8", "fp8"], help="weights measured last, as bench quant"
    )
    gpu.add_argument("--seed", type=int, default=0)
    gpu.add_argument("--json", default=None)
    gpu.set_defaults(func=_bench_gpu_check)
    route = bench.add_parser(
        "route", help="the prefix-aware router against Serve's default: two live engine replicas, or simulated ones"
    )
    route.add_argument("--model", default=DEFAULT_MODEL, help="the model of the live replicas")
    route.add_argument("--simulate", action="store_true", help="no model: N simulated replicas (page caches, service times)")
    route.add_argument("--tenants", type=int, default=None, help="default: 4 live, 16 simulated")
    route.add_argument("--turns", type=int, default=4)
    route.add_argument("--balance-abs-threshold", type=int, default=4, help="the router's load balance: a replica this many requests busier than the least loaded is skipped")
    route.add_argument("--balance-rel-threshold", type=float, default=1.5, help="and one this many times as busy")
    route.add_argument("--min-match-ratio", type=float, default=0.5, help="the share of a prompt's pages a replica must hold to be preferred for it")
    route.add_argument("--seed", type=int, default=0)
    route.add_argument("--json", default=None)
    live = route.add_argument_group("live (two engine replicas under serve run)")
    live.add_argument("--conversations", type=int, default=24)
    live.add_argument("--rate", type=float, default=0.25, help="new conversations per second (Poisson arrivals)")
    live.add_argument("--think-s", type=float, default=2.0, help="mean pause before a conversation's next turn")
    live.add_argument("--system-words", type=int, default=300, help="words of each conversation's system prompt")
    live.add_argument("--user-words", type=int, default=120, help="words of each user turn")
    live.add_argument("--max-tokens", type=int, default=32, help="new tokens per turn (EOS ignored)")
    live.add_argument(
        "--cache-tokens", type=int, default=32768, help="each routed replica's KV cache (the one replica has both's)"
    )
    live.add_argument("--max-model-len", type=int, default=2048)
    simulated = route.add_argument_group("--simulate")
    simulated.add_argument("--replicas", type=_int_list, default=[2, 8, 64], help="simulated replica counts; a comma list sweeps")
    simulated.add_argument("--conversations-per-replica", type=int, default=32, help="conversations per simulated replica")
    simulated.add_argument("--arrival-rate-per-replica", type=float, default=1.0, help="new conversations per second")
    simulated.add_argument("--cache-pages", type=int, default=2048, help="pages per simulated replica")
    simulated.add_argument("--page-size", type=int, default=16)
    route.set_defaults(func=_bench_route)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
