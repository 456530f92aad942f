"""Reading and writing rows: jsonl from any fsspec path (local, ``s3://``, ``hf://``), its compression told by
its first bytes, an archive (zip, tar, 7z, rar) refused in one line; local jsonl written and read back.
"""

from __future__ import annotations

import importlib.util
import io
import json
from collections.abc import Iterator
from typing import Any

import fsspec
import fsspec.compression

from rlhf.data.formats import RowError

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
"""Compression recognised from a file's first bytes (a JSON line starts with ``{``, never with these)."""


_ARCHIVES = (
    (0, b"PK\x03\x04", "zip"),
    (0, b"PK\x05\x06", "zip"),  # an empty zip
    (0, b"7z\xbc\xaf\x27\x1c", "7z"),
    (0, b"Rar!\x1a\x07", "rar"),
    (257, b"ustar\x00", "tar"),  # POSIX tar: the magic at byte 257 of the first header
    (257, b"ustar ", "tar"),  # GNU tar
)
"""Archives recognised from a file's first bytes: several files in a container, never JSON lines to read."""


HEAD_BYTES = 263  # enough to see every magic above

_CODECS = {"gzip": "zlib", "bz2": "bz2", "xz": "lzma", "zstd": "zstandard"}
"""The module each codec is read with: zlib, bz2 and lzma come with a Python built with
them, zstandard from PyPI (the product's own dependency)."""


_WIDE = (  # (a byte-order mark, the name iconv reads it by; a row's opening '{' or '[' without one, that name)
    (b"\xff\xfe\x00\x00", "UTF-32", (b"{\x00\x00\x00", b"[\x00\x00\x00"), "UTF-32LE"),
    (b"\x00\x00\xfe\xff", "UTF-32", (b"\x00\x00\x00{", b"\x00\x00\x00["), "UTF-32BE"),
    (b"\xff\xfe", "UTF-16", (b"{\x00", b"[\x00"), "UTF-16LE"),  # after UTF-32: its mark starts the same
    (b"\xfe\xff", "UTF-16", (b"\x00{", b"\x00["), "UTF-16BE"),
)


def _other_format(head: bytes) -> str | None:
    """What a (decompressed) stream is when its first bytes show it is not UTF-8 JSON lines, with what to do, or
    None: UTF-32 or UTF-16 text (a byte-order mark, or a row's opening ``{`` or ``[`` with NUL bytes beside it,
    whatever the text after it), a Parquet file, one JSON array (its first non-blank byte is ``[``: rows are
    objects, one a line)."""
    for mark, name, opening, bare in _WIDE:
        if head.startswith(mark) or head.startswith(opening):
            encoding = name if head.startswith(mark) else bare
            return f"{encoding} text, not UTF-8: convert it (iconv -f {encoding} -t UTF-8)"
    if head.startswith(b"PAR1"):
        return (
            "a Parquet file, not JSON lines: write its rows as JSON lines "
            "(pandas: read_parquet(...).to_json(out, orient='records', lines=True))"
        )
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return "one JSON array, not JSON lines (one object a line): write one row a line (jq -c '.[]')"
    return None


class _Prefixed(io.RawIOBase):
    """A read-only stream: ``head`` (bytes already read to sniff the format), then the rest of ``raw``."""

    def __init__(self, head: bytes, raw: Any) -> None:
        self._head, self._raw = head, raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._head[: len(buffer)] if self._head else self._raw.read(len(buffer))
        self._head = self._head[len(data) :]
        buffer[: len(data)] = data
        return len(data)


class _Zstd(io.RawIOBase):
    """A zstd stream (frames one after another) that fails where a frame is cut short: python-zstandard's own
    reader, which fsspec uses, ends there quietly, and a truncated download would read as a shorter file."""

    def __init__(self, raw: Any) -> None:
        import zstandard  # noqa: PLC0415 (only for a zstd file)

        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._frame, self._out, self._started = self._new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            data = self._raw.read(1 << 16)
            if not data:
                if self._started and not self._frame.eof:
                    raise EOFError("the stream ends inside a zstd frame")
                return 0
            while data:
                if self._frame.eof:  # the next frame
                    self._frame = self._new()
                self._started = True
                self._out += self._frame.decompress(data)
                data = self._frame.unused_data if self._frame.eof else b""
        size = min(len(buffer), len(self._out))
        buffer[:size], self._out = self._out[:size], self._out[size:]
        return size


def sniff_compression(head: bytes) -> str | None:
    """The compression of a file from its first bytes (gzip ``1f 8b``, bz2, xz, zstd), or None for plain.

    The content decides, never the name: ``pairs.JSONL.GZ``, ``pairs.jsonl.gz?download=true``
    or a gzip file without a suffix are read as gzip, a plain file named ``.gz`` as plain text.
    """
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def sniff_archive(head: bytes) -> str | None:
    """The archive format of a (decompressed) stream from its first :data:`HEAD_BYTES` bytes (zip, tar, 7z, rar),
    or None."""
    return next((name for at, magic, name in _ARCHIVES if head[at : at + len(magic)] == magic), None)


def _head(stream: Any, size: int) -> bytes:
    """Up to ``size`` bytes from the start of ``stream`` (fewer only at its end)."""
    head = b""
    while len(head) < size and (chunk := stream.read(size - len(head))):
        head += chunk
    return head


def read_jsonl(path: str, storage_options: dict[str, Any] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, parsed_json_or_RowError)`` for each non-blank line of a jsonl file, compressed or not.

    Args:
        path: any fsspec path or URL (local, ``s3://``, ``hf://datasets/...``, ``https://``, with or
            without a query string); its compression is read from its first bytes
            (:func:`sniff_compression`), whatever its name says.
        storage_options: passed to ``fsspec.open``.

    Yields:
        1-based line number and the parsed object, or a ``RowError`` naming the
        JSON or UTF-8 problem (the caller quarantines it), a number too long for Python to read (over 4,300
        digits) included. A UTF-8 byte-order mark before the first line is dropped.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is compressed with a codec that is not installed, is an archive (zip, tar, 7z, rar,
            compressed or not: :func:`sniff_archive`), or its stream breaks partway (truncated or corrupt: names
            the path and the last whole line read).
    """
    with fsspec.open(path, "rb", **(storage_options or {})) as raw:
        head = _head(raw, HEAD_BYTES)
        stream: Any = io.BufferedReader(_Prefixed(head, raw))
        compression = sniff_compression(head)
        if compression is not None:
            module = _CODECS.get(compression, compression)
            if compression not in fsspec.compression.compr or importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"{path}: the file is {compression}-compressed, but Python's {module} module, which reads it, "
                    "is not installed" + (" (pip install zstandard)" if module == "zstandard" else "")
                )
            if compression == "zstd":
                stream = io.BufferedReader(_Zstd(stream))
            else:
                stream = fsspec.compression.compr[compression](stream, mode="rb")
            try:
                head = _head(stream, HEAD_BYTES)
            except Exception as err:  # broken within its first bytes: EOFError, zlib.error, ... (as in _lines)
                raise ValueError(
                    f"{path}: reading stopped after line 0: its {compression} stream is truncated or corrupt "
                    f"({type(err).__name__}: {err})"
                ) from err
            stream = io.BufferedReader(_Prefixed(head, stream))
        archive = sniff_archive(head)
        if archive is not None:
            packed = f"a {compression}-compressed {archive}" if compression else f"a {archive}"
            raise ValueError(
                f"{path}: the file is {packed} archive, not JSON lines: unpack it and give its .jsonl file"
            )
        other = _other_format(head)
        if other is not None:
            first = f" ({compression}-compressed: decompress it first)" if compression else ""
            raise ValueError(f"{path}: the file is {other}{first}")
        for number, line in enumerate(_lines(stream, path, compression), start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
                not_text = _not_text(row)
                yield number, row if not_text is None else RowError(not_text)
            except UnicodeDecodeError as err:
                yield number, RowError(f"invalid UTF-8: {err.reason} at byte {err.start}")
            except json.JSONDecodeError as err:
                yield number, RowError(f"invalid JSON: {err.msg}")
            except ValueError as err:  # int("1" * 5000): Python reads at most 4,300 digits of an integer
                yield number, RowError(f"invalid JSON: a number too long to read ({str(err).split(';')[0]})")


def _not_text(value: Any, where: str = "") -> str | None:
    """Why ``value`` (a parsed JSON value) cannot be written as UTF-8, or None: JSON allows any ``\\uXXXX``
    escape, so a string or a key may hold a lone surrogate (``\\ud800``), which no UTF-8 text can. ``where`` is
    its place in the row (``chosen[1].content``)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return (
                f"not text: {where or 'the row'} holds a lone surrogate \\u{ord(value[err.start]):04x} at character "
                f"{err.start} (JSON allows it escaped; UTF-8 cannot hold it)"
            )
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            place = f"{where}.{key}" if where else str(key)
            found = _not_text(key, f"a key of {where or 'the row'}") or _not_text(item, place)
            if found:
                return found
    if isinstance(value, list):
        return next((found for i, item in enumerate(value) if (found := _not_text(item, f"{where}[{i}]"))), None)
    return None


def _lines(stream: Any, path: str, compression: str | None) -> Iterator[bytes]:
    """The lines of ``stream``; a read or decoder error partway (a truncated or corrupt gzip, bz2, xz or zstd
    stream, a dropped connection) becomes one ``ValueError`` naming the file and the last line read whole."""
    lines, count = iter(stream), 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except Exception as err:  # EOFError, zlib.error, lzma.LZMAError, ZstdError, OSError: the kind varies
            kind = f"its {compression} stream" if compression else "it"
            raise ValueError(
                f"{path}: reading stopped after line {count}: {kind} is truncated or corrupt "
                f"({type(err).__name__}: {err})"
            ) from err
        count += 1
        yield line


def write_jsonl(rows: list[dict[str, Any]], handle: io.TextIOBase) -> None:
    """Write rows as one JSON object a line (UTF-8, not ASCII-escaped)."""
    for row in rows:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a local jsonl file written by :func:`write_jsonl`.

    Raises:
        ValueError: a line is not valid JSON (names the file and line).
    """
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: invalid JSON: {err.msg}") from err
    return rows
