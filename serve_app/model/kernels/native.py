"""The engine's C kernels (`*.c` beside this module): built once per machine and loaded through ctypes.

A source is compiled with the system's C compiler (`$CC`, else `cc`) into `<cache_dir>/kernels/`,
keyed by the source, the flags, the compiler and the CPU, so a shared cache directory never hands
one CPU a build made for another. Built with -fopenmp, a kernel shares torch's OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded on this machine."""


def build_library(source: Path, cache_dir: Path) -> tuple[Path, ctypes.CDLL]:
    """Compile `source` into `cache_dir/kernels` unless already there; the library's path, loaded."""
    compiler = _compiler()
    target = Path(cache_dir) / "kernels" / f"{source.stem}-{_build_key(source, compiler)}.so"
    if not target.is_file():
        try:
            _compile(compiler, source, target)
        except OSError as error:  # e.g. a read-only cache directory
            raise KernelBuildError(f"cannot build into {target.parent}: {error}") from error
    try:
        return target, ctypes.CDLL(str(target))
    except OSError as error:
        raise KernelBuildError(f"cannot load {target}: {error}") from error


def _compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} is not on PATH")
    return compiler


def _build_key(source: Path, compiler: str) -> str:
    """A digest of everything the binary depends on: source, flags, compiler and CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    cpu = platform.machine()
    if Path("/proc/cpuinfo").is_file():
        cpu += next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), version.encode(), cpu.encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def _compile(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built), "-lm"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed to build {source.name}:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
