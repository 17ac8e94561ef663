"""A model's tokenizer in a form that loads without torch: transformers' tokenizer, exported once per tokenizer.

transformers builds a model's tokenizer from its folder (its class may rebuild the `tokenizers` pipeline that
`tokenizer.json` holds), and importing any of its tokenizer classes imports torch. The export writes what that
tokenizer is -- its `tokenizers` backend as transformers built it, its chat templates, its named special tokens,
its end-of-sequence id, its length and whether its decoding cleans up spaces -- to one JSON file in the cache
folder, keyed by the bytes of the folder's files other than weights. Processes that only tokenize (the ingress,
the engine replica beside its core) load that file with `tokenizers` alone; one that has no export yet makes it
in a short-lived child process, so torch is never mapped into it.

`python -m serve_app.model.tokenizer_export FOLDER OUT` writes the export of FOLDER's tokenizer to OUT.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TypedDict

# Files of a model folder that never shape its tokenizer (its weights), skipped when keying the export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".npz")
_NAMED_TEMPLATES = "additional_chat_templates"  # transformers' folder of a model's further named chat templates
_EXPORT_TIMEOUT_S = 600.0


class TokenizerExport(TypedDict):
    """What a transformers tokenizer is, as the export file holds it."""

    backend: str  # the `tokenizers.Tokenizer` transformers built, serialized (`Tokenizer.to_str`)
    chat_template: str | dict[str, str] | None  # one template, or named ones (`default`, `tool_use`)
    special_tokens: dict[str, str]  # `bos_token`, `eos_token`, ...: the template sees them as variables
    eos_token_id: int | None
    length: int  # `len(tokenizer)`: the vocabulary with its added tokens
    clean_up_spaces: bool  # whether decoding runs transformers' `clean_up_tokenization`


def export_tokenizer(folder: Path) -> TokenizerExport:
    """The export of `folder`'s tokenizer, made with transformers (which imports torch) in this process."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    backend = hf.backend_tokenizer
    # transformers encodes without truncation or padding and keeps special tokens whole unless told otherwise.
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = False
    clean_up = bool(hf.clean_up_tokenization_spaces) and (
        type(backend.model).__name__ != "BPE"
        or bool(getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    )
    return TokenizerExport(
        backend=backend.to_str(),
        chat_template=hf.chat_template,
        special_tokens=dict(hf.special_tokens_map),
        eos_token_id=None if hf.eos_token_id is None else int(hf.eos_token_id),
        length=len(hf),
        clean_up_spaces=clean_up,
    )


def load_tokenizer_export(folder: Path, cache_dir: Path) -> TokenizerExport:
    """The export of `folder`'s tokenizer, from `cache_dir` where it was made before; else made now (in this
    process where transformers is already loaded, else in a child process) and kept there."""
    target = cache_dir / "tokenizers" / f"{_tokenizer_key(folder)}.json"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        if "transformers.tokenization_utils_base" in sys.modules:
            _write(export_tokenizer(folder), target)
        else:
            _export_in_child(folder, target)
    return json.loads(target.read_text())


def _tokenizer_key(folder: Path) -> str:
    """A digest of what makes `folder`'s tokenizer and of transformers' version: its files but the weights, and
    of the model's config only what transformers picks a tokenizer class by (models that differ in nothing
    else share one export)."""
    digest = hashlib.sha256(importlib.metadata.version("transformers").encode())
    candidates = [*folder.iterdir(), *folder.glob(f"{_NAMED_TEMPLATES}/*")]
    for path in sorted(p for p in candidates if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)):
        if path.name.startswith("."):
            continue  # markers and locks, not the model's
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(_tokenizer_fields(path.read_bytes()) if path.name == "config.json" else path.read_bytes())
    return digest.hexdigest()[:32]


def _tokenizer_fields(config: bytes) -> bytes:
    """A model config's fields that AutoTokenizer reads: its `model_type` and `tokenizer_class`."""
    try:
        fields = json.loads(config)
    except ValueError:
        return config
    return json.dumps([fields.get("model_type"), fields.get("tokenizer_class")]).encode()


def _export_in_child(folder: Path, target: Path) -> None:
    command = [sys.executable, "-m", "serve_app.model.tokenizer_export", str(folder), str(target)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=_EXPORT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"could not load the tokenizer of {folder}: {done.stderr.strip()[-2000:]}")


def _write(export: TokenizerExport, target: Path) -> None:
    """Writes `export` to `target` whole or not at all (processes exporting at once each rename a full file)."""
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    with os.fdopen(handle, "w") as staged:
        json.dump(export, staged)
    os.chmod(staging, 0o644)
    os.replace(staging, target)


def _main(argv: list[str]) -> None:
    folder, target = map(Path, argv)
    _write(export_tokenizer(folder), target)


if __name__ == "__main__":
    _main(sys.argv[1:])
