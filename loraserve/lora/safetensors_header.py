"""The safetensors header of an adapter file, read and checked before a byte of tensor data is.

A weights file is client input (a load route path, a resolver folder): a 2 GB sparse file, or 8 sane
bytes followed by garbage, must cost a few bytes of I/O, not a 2 GB read. So the header is read alone
and must describe the whole file exactly, as the safetensors library itself requires: its length is in
range, it is a JSON object, every tensor has a known dtype, a shape and a byte range inside the data
region that matches the two, and the ranges tile the data region with no gap, overlap or tail. Only
then does the caller read the data, whose size the header has now accounted for.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from loraserve.json_limits import check_json_depth

# The library allows 100 MB; an adapter's header takes ~150 bytes per tensor (a LoRA on every module
# of a 7B model: ~70 KB), so a longer one is garbage that would otherwise be read before being refused.
MAX_HEADER_BYTES = 16 << 20
# Element sizes of every safetensors dtype but the sub-byte ones (no LoRA adapter stores those).
ELEMENT_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# The dtypes the zero-copy reader views directly; the others go through the library.
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_DIMS = 8  # LoRA tensors are 1-D or 2-D; anything stranger goes to the library

# key -> (dtype, shape, byte offset in the data region, element count): what the zero-copy reader needs.
FastLayout = dict[str, tuple[torch.dtype, list[int], int, int]]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str
    shape: list[int]
    begin: int  # byte range in the data region
    end: int


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A checked header: the file is exactly 8 + len(raw) + the tensors' bytes."""

    raw: bytes  # the 8 length bytes and the JSON header, as read
    entries: dict[str, TensorEntry]

    @property
    def data_start(self) -> int:
        return len(self.raw)

    def fast_layout(self) -> FastLayout | None:
        """The tensors as typed views can read them; None when some tensor needs the library (a dtype
        torch views do not cover, an offset not aligned to its element size, no elements)."""
        layout: FastLayout = {}
        for key, entry in self.entries.items():
            dtype = TORCH_DTYPES.get(entry.dtype)
            if dtype is None or len(entry.shape) > _MAX_DIMS:
                return None
            size, count = ELEMENT_SIZES[entry.dtype], math.prod(entry.shape)
            if count == 0 or self.data_start % size or entry.begin % size:
                return None
            layout[key] = (dtype, entry.shape, entry.begin, count)
        return layout


def read_header(fd: int, file_size: int) -> SafetensorsHeader:
    """Read and check the header of the safetensors file open as `fd` (`file_size` bytes long);
    ValueError saying what is wrong. Reads at most 8 + the header's length bytes."""
    if file_size < 8:
        raise ValueError("file too short for a safetensors header")
    header_len = int.from_bytes(_pread_exactly(fd, 8, 0), "little")
    if not 2 <= header_len <= min(MAX_HEADER_BYTES, file_size - 8):
        raise ValueError("safetensors header length is out of range")
    text = _pread_exactly(fd, header_len, 8)
    check_json_depth(text, "The safetensors header")  # a ValueError saying so, before decoding
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError):
        raise ValueError("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("safetensors __metadata__ must map names to strings")
    entries = {key: _entry(key, info) for key, info in header.items()}
    _check_tiling(entries, file_size - 8 - header_len)
    return SafetensorsHeader(header_len.to_bytes(8, "little") + text, entries)


def _entry(key: str, info: Any) -> TensorEntry:
    if not isinstance(info, dict):
        raise ValueError(f"tensor {_short(key)} has no dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ELEMENT_SIZES:
        raise ValueError(f"tensor {_short(key)} has an unsupported dtype {_short(str(dtype))}")
    if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
        raise ValueError(f"tensor {_short(key)} has no valid shape and data_offsets")
    begin, end = offsets
    if begin > end or end - begin != math.prod(shape) * ELEMENT_SIZES[dtype]:
        raise ValueError(f"tensor {_short(key)} does not match its shape")
    return TensorEntry(dtype, shape, begin, end)


def _check_tiling(entries: dict[str, TensorEntry], data_len: int) -> None:
    """The tensors must tile the data region exactly (the library's rule): no tensor aliases another,
    and the file holds nothing the header does not account for."""
    position = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise ValueError("safetensors tensors overlap or leave gaps in the data")
        position = entry.end
    if position != data_len:
        raise ValueError(
            "the file is shorter than its header says"
            if position > data_len
            else "the file holds more data than its header describes"
        )


def _pread_exactly(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise ValueError("the file is shorter than its header says")
        data += more
    return data


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _short(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")
