"""The layout key every tier key starts with: which weights made a page's KV and how it is laid out.

Pages from two models, two dtypes or quantizations, or two page sizes must never meet in a tier that
engines share. The weights count by content (a hash of the model's files), so two copies of one model
on two nodes share their pages and a fine-tune under a reused folder does not. Hashing reads the files
once (about a second per 500 MB here); the digest is kept under the cache folder, keyed by each file's
path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from serve_app.kv.storage import KVShape

_CHUNK = 16 * 2**20


def layout_key(model_path: Path, cache_dir: Path, quantization: str, page_size: int, shape: KVShape) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(weights_digest(model_path, cache_dir).encode())
    digest.update(json.dumps([quantization, page_size, shape.n_layers, shape.n_kv_heads, shape.head_dim,
                              str(shape.dtype)]).encode())
    return digest.digest()


def weights_digest(model_path: Path, cache_dir: Path) -> str:
    """A hash of the model's files (a folder's, or one file's), remembered while they stay unchanged."""
    files = sorted(p for p in ([model_path] if model_path.is_file() else model_path.rglob("*")) if p.is_file())
    files = [p for p in files if not p.name.startswith(".")]
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    memo = Path(cache_dir) / "kv-layout" / f"{hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:24]}.json"
    try:
        remembered = json.loads(memo.read_text())
        if remembered["stamp"] == [list(s) for s in stamp]:
            return remembered["digest"]
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        digest.update(str(path.relative_to(model_path) if path != model_path else path.name).encode() + b"\x00")
        with open(path, "rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    result = digest.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps({"stamp": stamp, "digest": result}))
    except OSError:
        pass  # a read-only cache folder: hash again next start
    return result
