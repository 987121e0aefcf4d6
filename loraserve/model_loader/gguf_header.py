"""`read_gguf_header`: a GGUF file's scalar metadata and its tensor table, read without its arrays.

Why not `gguf.GGUFReader` for this: it builds a numpy view for every element of every metadata array,
and a tokenizer's vocabulary and merges are ~100k strings: 8-12 s per process for SmolLM2's 100 MB file
(AVX2 EPYC), paid by every server start on a GGUF file. Checking a file needs only a few scalars and
each tensor's type; this reads them with `struct` from a memory map and steps over the arrays (a
string array costs one length read per string), in ~0.1 s. Conversion still uses `gguf`'s reader.

Format (GGUF v2/v3, either byte order): "GGUF", version u32, tensor count u64, metadata count u64;
each metadata entry a string key, a value type u32 and the value; each tensor a string name, n_dims
u32, n_dims u64 dims, a type u32 and a data offset u64. A string is a u64 length and UTF-8 bytes.
Every read is bounds-checked against the file, and counts are checked against the bytes left, so a
truncated or hostile header is a ValueError, never a long loop or a big allocation.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

# value type -> struct code of its fixed-size scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # as the file lists it (innermost first)
    type_code: int  # a ggml type (gguf.GGMLQuantizationType)


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # scalar and string values; an array is kept as its length only
    array_lengths: dict[str, int]
    tensors: tuple[GGUFTensorInfo, ...]


class _Cursor:
    """Bounds-checked little- or big-endian reads from a buffer."""

    def __init__(self, buf: Any, order: str) -> None:
        self.buf, self.order, self.at = buf, order, 0

    def take(self, code: str) -> Any:
        size = struct.calcsize(code)
        if self.at + size > len(self.buf):
            raise ValueError(f"truncated at byte {self.at}")
        (value,) = struct.unpack_from(self.order + code, self.buf, self.at)
        self.at += size
        return value

    def skip(self, num_bytes: int) -> None:
        if num_bytes < 0 or self.at + num_bytes > len(self.buf):
            raise ValueError(f"truncated at byte {self.at} (needs {num_bytes} more)")
        self.at += num_bytes

    def read_string(self) -> str:
        length = self.take("Q")
        start = self.at
        self.skip(length)
        return bytes(self.buf[start : self.at]).decode("utf-8", errors="replace")

    def count(self, n: int, min_item_bytes: int) -> int:
        """`n`, refused when that many items of at least `min_item_bytes` cannot fit in the bytes left."""
        if n * min_item_bytes > len(self.buf) - self.at:
            raise ValueError(f"count {n} at byte {self.at} exceeds the file")
        return n

    def skip_value(self, value_type: int, depth: int = 0) -> None:
        if value_type in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[value_type]))
        elif value_type == _STRING:
            self.skip(self.take("Q"))
        elif value_type == _ARRAY:
            self.skip_array(depth + 1)
        else:
            raise ValueError(f"unknown value type {value_type} at byte {self.at}")

    def skip_array(self, depth: int) -> int:
        if depth > 4:
            raise ValueError(f"arrays nested deeper than 4 at byte {self.at}")
        item_type = self.take("I")
        if item_type in _SCALARS:
            size = struct.calcsize(_SCALARS[item_type])
            n = self.count(self.take("Q"), size)
            self.skip(n * size)
            return n
        n = self.count(self.take("Q"), 8 if item_type == _STRING else 12)
        for _ in range(n):
            self.skip_value(item_type, depth)
        return n


def read_gguf_header(path: str) -> GGUFHeader:
    """The header of GGUF file `path`; ValueError when it is not one this reads (names the problem)."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise ValueError("the file is empty") from e
    try:
        with memoryview(buf) as view:
            return _parse(view)
    finally:
        buf.close()


def _parse(buf: memoryview) -> GGUFHeader:
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    little = _Cursor(buf, "<")
    little.skip(4)
    version = little.take("I")
    cursor = little
    if version & 0xFFFF == 0:  # a big-endian file
        cursor = _Cursor(buf, ">")
        cursor.at = 4
        version = cursor.take("I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} (this reads {', '.join(map(str, _VERSIONS))})")
    num_tensors, num_fields = cursor.take("Q"), cursor.take("Q")
    cursor.count(num_fields, 13)
    metadata: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(num_fields):
        key = cursor.read_string()
        value_type = cursor.take("I")
        if value_type in _SCALARS:
            metadata[key] = cursor.take(_SCALARS[value_type])
        elif value_type == _STRING:
            metadata[key] = cursor.read_string()
        elif value_type == _ARRAY:
            array_lengths[key] = cursor.skip_array(1)
        else:
            raise ValueError(f"metadata {key!r} has unknown value type {value_type}")
    cursor.count(num_tensors, 24)
    tensors = []
    for _ in range(num_tensors):
        name = cursor.read_string()
        num_dims = cursor.take("I")
        if num_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {num_dims} dimensions")
        shape = tuple(cursor.take("Q") for _ in range(num_dims))
        type_code = cursor.take("I")
        cursor.skip(8)  # its data offset
        tensors.append(GGUFTensorInfo(name, shape, type_code))
    return GGUFHeader(version, metadata, array_lengths, tuple(tensors))
