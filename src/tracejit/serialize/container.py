"""The zip container: exactly graph.json and weights.safetensors, written atomically, read with
every size bounded before it is trusted (declared sizes, actual sizes, compression ratio)."""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from typing import Any, BinaryIO

import safetensors.torch
import torch

from ..errors import LoadError
from .format import GRAPH_MEMBER, WEIGHTS_MEMBER
from .limits import MAX_COMPRESSION_RATIO, MAX_GRAPH_JSON_BYTES, MAX_TOTAL_BYTES, RATIO_CHECK_BYTES

_ZIP_MAGIC = b"PK\x03\x04"
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # the same graph dumps to the same bytes
# zipfile, zlib and the decompressors it may pick raise these on damaged archives
_ARCHIVE_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError,
                   zlib.error, UnicodeDecodeError, KeyError, OverflowError, RuntimeError)


def pack(graph_json: bytes, tensors: dict[str, torch.Tensor]) -> bytes:
    """The file's bytes: graph.json deflated, the weights stored as they are."""
    weights = safetensors.torch.save({key: t.cpu() for key, t in tensors.items()})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo(GRAPH_MEMBER, _FIXED_TIME), graph_json, compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr(zipfile.ZipInfo(WEIGHTS_MEMBER, _FIXED_TIME), weights, compress_type=zipfile.ZIP_STORED)
    return buffer.getvalue()


def write(target: Any, data: bytes) -> None:
    """Write to a path (through a temporary file, so a failed dump leaves no half file) or a binary
    file object."""
    if isinstance(target, (str, os.PathLike)):
        path = os.fspath(target)
        temporary = f"{path}.tmp{os.getpid()}"
        try:
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)
        except OSError as error:  # it named the temporary file, which the caller never heard of
            hint = f"; name a file in it, like {os.path.join(path, 'model.tjit')!r}" if os.path.isdir(path) else ""
            raise type(error)(error.errno, f"dump(): cannot write {path!r}: {error.strerror or error}{hint}") from None
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    elif isinstance(target, io.TextIOBase):
        raise TypeError("dump(): the file object must be opened in binary mode ('wb'), it is a text file")
    elif hasattr(target, "write"):
        target.write(data)
    else:
        raise TypeError(f"dump(): file must be a path or a binary file object, got {type(target).__name__}")


def read_bytes(source: Any) -> bytes:
    """All bytes of a path, a binary file object or a bytes-like object, at most MAX_TOTAL_BYTES."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, io.TextIOBase):
        raise TypeError("tracejit.load: the file object must be opened in binary mode ('rb'), it is a text file")
    elif isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as f:
                data = _bounded_read(f, MAX_TOTAL_BYTES + 1, archive=True)
        except OSError as error:
            raise LoadError(f"cannot read {os.fspath(source)!r}: {error.strerror or error}") from None
        if not data:
            raise LoadError(f"{os.fspath(source)!r} is empty (0 bytes): not a tracejit graph file")
    elif hasattr(source, "read"):
        data = _bounded_read(source, MAX_TOTAL_BYTES + 1, archive=True)
        if not data:  # `dump(buf)` then `load(buf)`: the stream is at its end
            where = _position(source)
            raise LoadError(f"read 0 bytes from the file object: it is at its end{where} (after writing to a stream, "
                            f"seek(0) before loading from it, or pass buf.getvalue())")
    else:
        raise TypeError(f"tracejit.load: expected a path, a binary file object or bytes, got {type(source).__name__}")
    if len(data) > MAX_TOTAL_BYTES:
        raise LoadError(f"the file is larger than the limit of {MAX_TOTAL_BYTES} bytes")
    return data


def _position(stream: Any) -> str:
    try:
        return f" (position {stream.tell()})"
    except (AttributeError, OSError, ValueError):
        return ""


def unpack(data: bytes) -> tuple[bytes, dict[str, torch.Tensor]]:
    """graph.json's bytes and weights.safetensors' tensors from a file's bytes."""
    if not data.startswith(_ZIP_MAGIC):
        raise LoadError("not a tracejit graph file: it is not a zip archive (a .tjit file starts with 'PK')")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = _checked_members(archive)
            graph_json = _read_member(archive, members[GRAPH_MEMBER])
            weights = _read_member(archive, members[WEIGHTS_MEMBER])
    except LoadError:
        raise
    except _ARCHIVE_ERRORS as error:
        raise LoadError(f"damaged archive: {type(error).__name__}: {str(error)[:200]}") from None
    try:
        tensors = safetensors.torch.load(weights)
    except Exception as error:  # noqa: BLE001 - the safetensors parser's error type has no stable import path
        raise LoadError(f"{WEIGHTS_MEMBER} is not a valid safetensors file: {str(error)[:200]}") from None
    return graph_json, tensors


def _checked_members(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    infos = archive.infolist()
    names = sorted(info.filename for info in infos)
    if names != sorted([GRAPH_MEMBER, WEIGHTS_MEMBER]):
        raise LoadError(f"the archive must hold exactly {GRAPH_MEMBER} and {WEIGHTS_MEMBER}, it holds "
                        f"{', '.join(repr(n[:60]) for n in names[:8]) or 'nothing'}")
    total = 0
    for info in infos:
        limit = MAX_GRAPH_JSON_BYTES if info.filename == GRAPH_MEMBER else MAX_TOTAL_BYTES
        if info.file_size > limit:
            raise LoadError(f"{info.filename} declares {info.file_size} bytes, more than the limit of {limit}")
        total += info.file_size
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise LoadError(f"{info.filename} uses compression method {info.compress_type}; only stored and "
                            f"deflated members are read")
        if info.flag_bits & 0x1:
            raise LoadError(f"{info.filename} is encrypted")
        if info.file_size > RATIO_CHECK_BYTES and info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1):
            raise LoadError(f"{info.filename} expands {info.compress_size} bytes to {info.file_size}, a ratio above "
                            f"{MAX_COMPRESSION_RATIO}: refused as a possible zip bomb")
    if total > MAX_TOTAL_BYTES:
        raise LoadError(f"the members declare {total} bytes together, more than the limit of {MAX_TOTAL_BYTES}")
    return {info.filename: info for info in infos}


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    with archive.open(info) as member:
        data = _bounded_read(member, info.file_size + 1)
    if len(data) != info.file_size:
        raise LoadError(f"{info.filename} declares {info.file_size} bytes but holds "
                        f"{'more' if len(data) > info.file_size else len(data)}")
    return data


def _bounded_read(stream: BinaryIO, limit: int, archive: bool = False) -> bytes:
    """At most `limit` bytes; for an `archive` (a whole file), none after a start that is not the
    zip magic (`/dev/zero` is refused after 4 bytes, not 64 GiB). A read may return fewer bytes
    than asked for (a pipe, a socket, a raw stream): only an empty one ends the data."""
    chunks, size = [], 0
    checked = not archive  # the first bytes are the zip magic, once there are enough of them
    while size < limit:
        want = len(_ZIP_MAGIC) - size if not checked else min(1 << 24, limit - size)
        chunk = stream.read(want)
        if chunk is None:  # a non-blocking raw stream with no data yet
            raise LoadError("the file object has no data ready (a non-blocking stream returned None); "
                            "pass a blocking stream or the file's bytes")
        if not chunk:
            break
        if not isinstance(chunk, (bytes, bytearray)):
            raise TypeError(f"tracejit.load: the file object must be opened in binary mode, it returned "
                            f"{type(chunk).__name__}")
        if len(chunk) > want:  # a stream handing out more than asked for: keep within the bounds
            chunk = chunk[:want]
        chunks.append(bytes(chunk))
        size += len(chunk)
        if not checked and size >= len(_ZIP_MAGIC):
            if b"".join(chunks)[:len(_ZIP_MAGIC)] != _ZIP_MAGIC:
                break
            checked = True
    return b"".join(chunks)
