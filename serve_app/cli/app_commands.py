"""The app's commands: `serve-app serve [CONFIG]` (Serve's own `serve run`, as the README says) and
`serve-app prepare-model` (a model made ready to load)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from serve_app.config import DEFAULT_MODEL, default_cache_dir


def add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run the app: `serve run CONFIG`, as the README says")
    serve.add_argument("config", nargs="?", default="serve_config.yaml", help="the Serve config (default: %(default)s)")
    serve.add_argument(
        "--address", default=None,
        help="the Ray cluster to run on (default: $RAY_ADDRESS, else the one `ray start` started here, else a new one)",
    )
    serve.set_defaults(func=_serve)


def add_prepare_model(commands: argparse._SubParsersAction) -> None:
    prepare = commands.add_parser("prepare-model", help="make a model ready to load (the embedded one is converted once)")
    prepare.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="an embedded model name or a local folder")
    prepare.add_argument("--cache-dir", default=default_cache_dir(), help="where prepared models are kept")
    prepare.set_defaults(func=_prepare_model)


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
