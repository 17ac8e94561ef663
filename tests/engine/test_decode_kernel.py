"""The paged decode kernel: same attention as the torch path, its build cache, and its fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from serve_app.kv.page_cache import PageCache
from serve_app.kv.storage import KVShape
from serve_app.kv.view import BatchEntry
from serve_app.model.kernels.decode_kernel import (
    DecodeKernel,
    build_decode_kernel,
    load_decode_kernel,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel:
    return build_decode_kernel(tmp_path_factory.mktemp("kernels"))


def _filled_cache(shape: KVShape, page_size: int, lengths: list[int]) -> PageCache:
    """A page cache whose tasks 0..N-1 hold `lengths` tokens of random k/v in every layer."""
    cache = PageCache(shape, num_tokens=4096, page_size=page_size, device=CPU, enable_prefix_caching=False)
    for task in range(len(lengths)):
        assert cache.admit(task, [task], "") == 0
    # Grow the tasks a token at a time, in turn, so that no task's pages are contiguous.
    for step in range(max(lengths)):
        for task, length in enumerate(lengths):
            if step < length:
                assert cache.grow(task, step + 1)
    # One-token entries first, as the scheduler orders a batch.
    entries = sorted((BatchEntry(task, 0, length) for task, length in enumerate(lengths)), key=lambda e: e.num_new != 1)
    view = cache.view(entries)
    total = sum(lengths)
    for layer in range(shape.n_layers):
        view.write(layer, torch.randn(total, shape.n_kv_heads, shape.head_dim), torch.randn(total, shape.n_kv_heads, shape.head_dim))
    return cache


@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "page_size", "head_dim"),
    [
        (9, 3, 16, 64),  # the packaged model
        (4, 4, 7, 64),
        (8, 2, 1, 64),
        (10, 2, 16, 128),  # 5 heads a kv head: a group of 4 held in registers, then one more
        (4, 2, 5, 16),  # scores 16 tokens at a time, values by plain loops
        (6, 3, 4, 8),  # plain loops throughout
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])  # kv_cache_dtype
def test_kernel_matches_sdpa_over_the_gathered_context(
    kernel: DecodeKernel, n_heads, n_kv_heads, page_size, head_dim, kv_dtype: torch.dtype
) -> None:
    shape = KVShape(n_layers=2, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=kv_dtype)
    lengths = [300, 41, 17, 16, 1, 90]
    cache = _filled_cache(shape, page_size, lengths)
    for task, length in enumerate(lengths):
        assert cache.grow(task, length + 1)
    view = cache.view([BatchEntry(task, length, 1) for task, length in enumerate(lengths)])
    view.write(1, torch.randn(len(lengths), n_kv_heads, head_dim), torch.randn(len(lengths), n_kv_heads, head_dim))
    query = torch.randn(len(lengths), n_heads, head_dim)
    assert view.decode is not None and view.decode.context_lens.tolist() == [n + 1 for n in lengths]

    got = kernel(query, cache.storage.k[1], cache.storage.v[1], view.decode.page_tables, view.decode.context_lens, 0.125)

    for row, task_pages in enumerate(cache.tasks[t].pages for t in range(len(lengths))):
        n = lengths[row] + 1
        # The 16-bit elements as they are, widened: the kernel reads them so.
        k = cache.storage.k[1][task_pages].reshape(-1, n_kv_heads, head_dim)[:n].transpose(0, 1).float()
        v = cache.storage.v[1][task_pages].reshape(-1, n_kv_heads, head_dim)[:n].transpose(0, 1).float()
        want = F.scaled_dot_product_attention(query[row][:, None], k, v, scale=0.125, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[row], want, atol=2e-6, rtol=1e-5)


def test_kernel_rejects_tensors_it_cannot_read(kernel: DecodeKernel) -> None:
    k = torch.zeros(4, 16, 2, 8)
    tables = torch.zeros(1, 1, dtype=torch.long)
    lens = torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.zeros(1, 4, 8, dtype=torch.float64), k, k, tables, lens, 1.0)
    with pytest.raises(ValueError, match="bfloat16 or float16 k/v"):
        kernel(torch.zeros(1, 4, 8), k.double(), k.double(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="bfloat16 or float16 k/v"):
        kernel(torch.zeros(1, 4, 8), k.half(), k.bfloat16(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel(torch.zeros(1, 4, 8), k, k, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.zeros(1, 3, 8), k, k, tables, lens, 1.0)


def test_build_is_cached_per_source_and_reused(tmp_path: Path) -> None:
    first = build_decode_kernel(tmp_path)
    second = build_decode_kernel(tmp_path)
    assert first.library == second.library and first.library.parent == tmp_path / "kernels"
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.library.name]


def test_without_a_compiler_the_torch_path_runs(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="serve_app.model.kernels.decode_kernel"):
        assert load_decode_kernel(tmp_path, CPU, torch.float32) is None
    assert "falls back to torch" in caplog.text and "no C compiler" in caplog.text
    assert not (tmp_path / "kernels").exists()


def test_an_unwritable_cache_dir_means_the_torch_path(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="serve_app.model.kernels.decode_kernel"):
        assert load_decode_kernel(blocker, CPU, torch.float32) is None
    assert "cannot build into" in caplog.text


def test_the_kernel_applies_to_float32_on_cpu_only(tmp_path: Path) -> None:
    assert load_decode_kernel(tmp_path, torch.device("cuda"), torch.float32) is None
    assert load_decode_kernel(tmp_path, CPU, torch.bfloat16) is None
    assert isinstance(load_decode_kernel(tmp_path, CPU, torch.float32), DecodeKernel)
