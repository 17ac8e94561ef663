"""The memory a start frees goes back to the system, not only to the allocator."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Many small blocks (below glibc's threshold for a mapping of their own), a few kept so the heap cannot shrink from
# its top by itself; the process's own memory measured with them freed, then after giving the freed pages back.
_PROBE = """
import gc, sys
from serve_app.engine.freed_memory import give_back_freed_memory

def own_kib():
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("RssAnon:")))

blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MiB in 64 KiB blocks
kept = blocks[-1]
del blocks
gc.collect()
before = own_kib()
assert give_back_freed_memory()
print(before, own_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_freed_small_blocks_go_back_to_the_system() -> None:
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    before, after = map(int, probe.stdout.split())
    assert before - after > 200 * 1024, (before, after)  # KiB: most of the 250 MiB freed
