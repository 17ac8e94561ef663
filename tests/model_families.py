"""Real chat templates and tokenizers of other model families, for tests: taken from the llama.cpp sources that
llama-cpp-python's source package on PyPI carries (`models/templates/*.jinja`, `models/ggml-vocab-*.gguf`).

`python -m tests.model_families` (run by `make test`) downloads that package once into the cache folder and keeps
only those files; the tests read them from there. Qwen3's tokenizer is Qwen2's byte-level BPE (the vocabulary
llama.cpp ships) with Qwen3's added tokens at their ids (its `tokenizer_config.json` lists them).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from serve_app.config import default_cache_dir

PACKAGE = "llama-cpp-python==0.3.36"
PACKAGE_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
FOLDER = default_cache_dir() / "model-families"
_WANTED = ("models/templates/", "models/ggml-vocab-qwen2.gguf")

# Qwen3's added tokens after <|im_end|> (151645), in id order from 151646; False: not special (kept in text).
QWEN3_ADDED = (
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
QWEN3_FIRST_ADDED = 151646


def template(name: str) -> Path:
    """A family's real chat template, by llama.cpp's file name (`Qwen-Qwen3-0.6B`, `openai-gpt-oss-120b`, ...)."""
    return _sources() / "templates" / f"{name}.jinja"


def qwen3_tokenizer() -> Path:
    """A folder with Qwen3's tokenizer (`tokenizer.json`, `tokenizer_config.json`) and its real chat template."""
    folder = FOLDER / "qwen3-tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer

    sources = _sources()
    with tempfile.TemporaryDirectory() as scratch:
        AutoTokenizer.from_pretrained(sources, gguf_file="ggml-vocab-qwen2.gguf").save_pretrained(scratch)
        tokenizer = json.loads((Path(scratch) / "tokenizer.json").read_text())
    last = QWEN3_FIRST_ADDED + len(QWEN3_ADDED)
    added = [t for t in tokenizer["added_tokens"] if t["id"] < QWEN3_FIRST_ADDED]
    vocab = {token: i for token, i in tokenizer["model"]["vocab"].items() if i < QWEN3_FIRST_ADDED}
    for offset, (content, special) in enumerate(QWEN3_ADDED):
        token_id = QWEN3_FIRST_ADDED + offset
        vocab[content] = token_id
        added.append(dict(added[0], id=token_id, content=content, special=special))
    assert len(vocab) == last
    tokenizer["added_tokens"], tokenizer["model"]["vocab"] = added, vocab
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 131072, "clean_up_tokenization_spaces": False,
    }
    partial = folder.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "tokenizer_config.json").write_text(json.dumps(config))
    (partial / "chat_template.jinja").write_text(template("Qwen-Qwen3-0.6B").read_text())
    (partial / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    partial.rename(folder)
    return folder


def _sources() -> Path:
    """The kept llama.cpp files (`templates/`, the vocabularies), downloaded and unpacked the first time."""
    kept = FOLDER / "llama.cpp"
    if (kept / "templates").is_dir():
        return kept
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", download],
            check=True,
        )
        (archive,) = Path(download).glob("*.tar.gz")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != PACKAGE_SHA256:
            raise RuntimeError(f"{archive.name}: sha256 {digest}, expected {PACKAGE_SHA256}")
        partial = kept.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                inside = member.name.split("/vendor/llama.cpp/", 1)[-1]
                if member.isfile() and inside.startswith(_WANTED) and not inside.endswith(".md"):
                    target = partial / inside.removeprefix("models/")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
        partial.rename(kept)
    return kept


if __name__ == "__main__":
    print(qwen3_tokenizer())
