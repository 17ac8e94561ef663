"""`serve-app bench random-model`: a Llama-shaped model of about 1B parameters with random weights (by default
Llama 3.2 1B's shape on the tokenizer of `--model`, the embedded model's), for timing the servers where real models live: reading
the weights bounds each decode step. Made once with transformers into `<cache dir>/models/bench/<name>`; with
`--llama-cpp`, a llama.cpp source tree with its tools built, also converted for llama-server by llama.cpp's own
`convert_hf_to_gguf.py` (F32) and `llama-quantize` (Q8_0, Q4_1) beside it. Its tokens mean nothing: time only."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from serve_app.config import default_cache_dir
from serve_app.model.loader import prepare_once, resolve_model_path

# Llama 3.2 1B's decoder on SmolLM2's 49152-token vocabulary: 1.07B parameters (the LM head tied).
SHAPE = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
GGUF_KINDS = ("q8_0", "q4_1")  # quantized from the F32 file by llama-quantize
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt",
)


def make_model(folder: Path, seed: int, tokenizer_from: Path, shape: dict | None = None) -> Path:
    """The random model's `folder` (made once): config (`shape`, else SHAPE), float32 safetensors, and the
    tokenizer of the model folder `tokenizer_from`."""
    name = folder.name

    def fill(staging: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        source = LlamaConfig.from_pretrained(tokenizer_from)
        config = LlamaConfig(
            **(shape or SHAPE), vocab_size=source.vocab_size, bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id,
            dtype="float32",
        )
        print(f"Making {name} ({seed=}) with transformers (done once) ...", flush=True)
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(staging, safe_serialization=True)
        for file in _TOKENIZER_FILES:
            if (tokenizer_from / file).is_file():
                shutil.copy(tokenizer_from / file, staging / file)

    return prepare_once(folder, f"random weights, seed {seed}", fill)


def make_ggufs(folder: Path, llama_cpp: Path) -> dict[str, Path]:
    """`folder` as GGUF files for llama-server beside it (each made once): F32 by llama.cpp's converter, and each of
    GGUF_KINDS from that by its llama-quantize."""
    files = {"f32": folder.parent / f"{folder.name}-f32.gguf"}
    if not files["f32"].is_file():
        _run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
              "--outfile", str(files["f32"])])
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    for kind in GGUF_KINDS:
        files[kind] = folder.parent / f"{folder.name}-{kind}.gguf"
        if not files[kind].is_file():
            _run([str(quantize), str(files["f32"]), str(files[kind]), kind.upper()])
    return files


def _run(command: list[str]) -> None:
    print("running " + " ".join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"serve-app bench random-model: {Path(command[0]).name} failed:\n{result.stderr[-4000:]}")


def main(args: argparse.Namespace) -> None:
    cache_dir = default_cache_dir()
    folder = make_model(
        cache_dir / "models" / "bench" / args.name, args.seed, resolve_model_path(args.model, cache_dir)
    )
    print(f"model: {folder}")
    if args.llama_cpp:
        for kind, path in make_ggufs(folder, Path(args.llama_cpp)).items():
            print(f"gguf {kind}: {path}")
