"""ResultsFile: a batch's results file on any filesystem pyarrow knows (a local path or a URI), written a line per
answered request as results arrive, so that an interrupted run keeps every result it wrote. Opened again, it
says which lines it already answers (the resumed run does only the others) and drops a last line cut short."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow
import pyarrow.fs

from serve_app.batch.file_format import result_key


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
        than whole result lines (a run stopped mid-line), it is rewritten with its whole lines only."""
        if self._fs.get_file_info(self._path).type == pyarrow.fs.FileType.NotFound:
            parent = self._path.rsplit("/", 1)[0]
            if parent:
                self._fs.create_dir(parent, recursive=True)
            self._stream = self._fs.open_output_stream(self._path)
            return set()
        keys: set[str] = set()
        kept: list[bytes] = []
        whole = True
        for line in self._lines():
            try:
                key = result_key(json.loads(line))
            except ValueError:
                key = None
            if key is None or not line.endswith(b"\n"):
                whole = False
                continue
            keys.add(key)
            kept.append(line)
        if whole:
            try:
                self._stream = self._fs.open_append_stream(self._path)
                return keys
            except (NotImplementedError, pyarrow.ArrowNotImplementedError):
                pass  # an object store: the object is written again, whole
        self._stream = self._fs.open_output_stream(self._path)
        for line in kept:
            self._stream.write(line)
        self._stream.flush()
        return keys

    def _lines(self) -> list[bytes]:
        """The file's lines, each with its newline (the last one may lack it)."""
        with self._fs.open_input_stream(self._path) as source:
            data = source.read()
        return [line for line in data.splitlines(keepends=True) if line.strip()]

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
