"""ResultsFile: a batch's results file on any filesystem pyarrow knows (a local path or a URI), written a line per
answered request as results arrive, so that an interrupted run keeps every result it wrote. Opened again, it
says which lines it already answers (the resumed run does only the others) and drops a last line cut short."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow
import pyarrow.fs

from serve_app.batch.file_format import result_key

READ_CHUNK_BYTES = 1 << 20
# Beside the results file while it is rewritten: its lines, until the rewrite is done.
STAGED_SUFFIX = ".rewriting"


def filesystem_of(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and path a local path or a URI (`s3://`, `gs://`, `hdfs://`, `file://`) names."""
    if "://" not in uri:
        return pyarrow.fs.LocalFileSystem(), str(Path(uri).resolve())
    return pyarrow.fs.FileSystem.from_uri(uri)


class ResultsFile:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._fs, self._path = filesystem_of(uri)
        self._stream: pyarrow.NativeFile | None = None

    def open(self) -> set[str]:
        """Open for writing; the keys (`line_key`) of the results the file holds already. Where it holds more
        than whole result lines (a run stopped mid-line), it is rewritten with its whole lines only (through a
        copy aside, which the next open finishes from if this one is cut short)."""
        staged = f"{self._path}{STAGED_SUFFIX}"
        if self._exists(staged):  # a rewrite was cut short: the copy aside holds the results
            if self._exists(self._path):
                self._fs.delete_file(self._path)
            self._fs.move(staged, self._path)
        if not self._exists(self._path):
            parent = self._path.rsplit("/", 1)[0]
            if parent:
                self._fs.create_dir(parent, recursive=True)
            self._stream = self._fs.open_output_stream(self._path)
            return set()
        keys: set[str] = set()
        whole = True
        for line in self._lines(self._path):
            key = _whole_line_key(line)
            if key is None:
                whole = False
            else:
                keys.add(key)
        if whole:
            try:
                self._stream = self._fs.open_append_stream(self._path)
                return keys
            except (NotImplementedError, pyarrow.ArrowNotImplementedError):
                pass  # an object store: the object is written again, whole
        self._fs.move(self._path, staged)
        self._stream = self._fs.open_output_stream(self._path)
        for line in self._lines(staged):
            if _whole_line_key(line) is not None:
                self._stream.write(line)
        self._stream.flush()
        self._fs.delete_file(staged)
        return keys

    def _exists(self, path: str) -> bool:
        return self._fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound

    def _lines(self, path: str) -> Iterator[bytes]:
        """The file's non-blank lines, each with its newline (the last one may lack it), read a chunk at a time."""
        with self._fs.open_input_stream(path) as source:
            rest = b""
            while chunk := source.read(READ_CHUNK_BYTES):
                *lines, rest = (rest + chunk).split(b"\n")
                yield from (line + b"\n" for line in lines if line.strip())
            if rest.strip():
                yield rest

    def write(self, results: list[str]) -> None:
        """Append result lines (JSON text each) and flush them."""
        if self._stream is None:
            raise RuntimeError("the results file is not open")
        if results:
            self._stream.write("".join(f"{result}\n" for result in results).encode())
            self._stream.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _whole_line_key(line: bytes) -> str | None:
    """The key of a whole result line (with its newline); None for a line cut short or not a result."""
    if not line.endswith(b"\n"):
        return None
    try:
        return result_key(json.loads(line))
    except ValueError:
        return None
