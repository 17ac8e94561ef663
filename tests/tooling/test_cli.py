"""`serve-app` and every subcommand: each option has a help line, and `--help` shows its default."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(build_parser()))


def test_every_command_is_reached() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"serve", "prepare-model", "bench", "bench engine", "bench compare", "bench soak", "bench route"} <= names
    assert len(names) >= 20


@pytest.mark.parametrize("path, parser", COMMANDS, ids=[" ".join(p) or "serve-app" for p, _ in COMMANDS])
def test_every_option_has_a_help_line_and_its_default(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help, f"serve-app {' '.join(path)} {action.option_strings or action.dest}: no help"
        default = action.default
        if isinstance(default, list):  # as it is typed: 1,8,32
            default = ",".join(map(str, default)) or "none"
        if action.option_strings and default is not None and not isinstance(default, bool):
            assert f"(default: {default})" in " ".join(text.split()), (path, action.dest)


def test_serve_app_help_runs_as_a_command() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / "serve-app"), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "serve" in out and "bench" in out and "prepare-model" in out
    out = subprocess.run([str(bin_dir / "serve-app"), "serve", "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert "(default: serve_config.yaml)" in out and "--address" in out


def test_every_bench_command_takes_a_model() -> None:
    benches = {path[1]: parser for path, parser in COMMANDS if len(path) == 2 and path[0] == "bench"}
    lacking = {name for name, parser in benches.items() if not any(a.dest == "model" for a in parser._actions)}
    assert len(benches) >= 16 and lacking == set()


def test_a_list_default_is_shown_as_it_is_typed() -> None:
    engine = dict(COMMANDS)[("bench", "engine")].format_help()
    assert "(default: 16)" in " ".join(engine.split()) and "[16]" not in engine
    compare = " ".join(dict(COMMANDS)[("bench", "compare")].format_help().split())
    assert "(default: 1,16,64,128)" in compare and "(default: completions,chat)" in compare


def test_bench_clients_servers_name_their_model_or_take_the_option() -> None:
    from serve_app.cli.bench_commands.clients import servers_of

    ours, theirs = servers_of(["ours=http://127.0.0.1:8000", "llama=http://127.0.0.1:8090=smollm2"], "served-name")
    assert (ours.name, ours.url, ours.model) == ("ours", "http://127.0.0.1:8000", "served-name")
    assert (theirs.name, theirs.url, theirs.model) == ("llama", "http://127.0.0.1:8090", "smollm2")
    with pytest.raises(SystemExit, match="NAME=URL"):
        servers_of(["just-a-name"], "served-name")


def test_a_model_source_is_served_by_its_name(tmp_path: Path) -> None:
    from serve_app.bench.servers import served_id

    assert served_id("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a Hub id
    (tmp_path / "Qwen3-0.6B").mkdir()
    assert served_id(str(tmp_path / "Qwen3-0.6B")) == "Qwen3-0.6B"
    assert served_id("weights/smollm2-q8_0.gguf") == "smollm2-q8_0"
