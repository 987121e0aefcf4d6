"""Reading an adapter's weights file: tensors, a content digest and a range check, fast.

A cold adapter's first request waits for all of this. In the common case (one safetensors file of
one float dtype, tensors stored in name order) two threads read the two halves of the data into one
uninitialised buffer and hash them (`digest.py`; the GIL is released for both), while this thread
builds the tensors as views of that buffer: one typed view per dtype, one `as_strided` per tensor.
Values are range-checked (finite, no overflow once scaled) with one min/max over the data region.
Per-tensor torch ops cost ~5-20 us each on a small CPU and an all-7-projection adapter of a 30-layer
model has 420 tensors, hence the care. Anything unusual (unaligned offsets, gaps, exotic dtypes)
goes through the safetensors library; `.bin` / `.pt` files load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import safetensors.torch
import torch

from loraserve.errors import LoRAAdapterError
from loraserve.lora.digest import HashPart, PendingDigest

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_SIZES = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in _DTYPES.values()}
_MAX_HEADER = 100 * 1024 * 1024
_MAX_DIMS = 8  # LoRA tensors are 1-D or 2-D; anything stranger goes to the library


@dataclass(slots=True)
class AdapterFile:
    """The tensors of one weights file, and the raw bytes they view (safetensors fast path only)."""

    name: str
    path: Path
    tensors: dict[str, torch.Tensor]
    raw: torch.Tensor | None = None  # uint8: the whole file, header and data, as read
    data_start: int = 0  # where the tensor data begins in `raw`
    # The two halves (by name order) of the content, read and being hashed by the reader's threads.
    hash_parts: list[HashPart] | None = None

    def digest(self, config_json: str) -> str:
        return self.start_digest(config_json).result()

    def start_digest(self, config_json: str) -> PendingDigest:
        """Start hashing the adapter's content on two threads; `.result()` waits for the hex digest.

        The digest is sha256 over the config, every tensor's name, dtype and shape (in name order),
        and the sha256 of the bytes of each half of the tensors (in name order): the content,
        whatever the file format. Two halves let two cores share the work; when the file stores its
        tensors back to back in name order (what safetensors writes for one dtype), each half is a
        single hashlib call straight from the file buffer, which releases the GIL throughout, so
        the hashing overlaps the parsing and the slot upload that follow.
        """
        keys = sorted(self.tensors)
        meta = "".join(f"{k}|{self.tensors[k].dtype}|{tuple(self.tensors[k].shape)}\n" for k in keys)
        prefix = hashlib.sha256(config_json.encode())
        prefix.update(meta.encode())
        half = len(keys) // 2
        parts = self.hash_parts or [self._hash_part(keys[:half]), self._hash_part(keys[half:])]
        return PendingDigest(prefix, parts)

    def _hash_part(self, keys: list[str]) -> HashPart:
        tensors = [self.tensors[k].detach().contiguous().cpu() for k in keys]
        return HashPart(lambda: (t.reshape(-1).view(torch.uint8).numpy().data for t in tensors))

    def max_abs(self) -> float | None:
        """The largest |value| of all tensors, in one pass when the file holds one float dtype; None
        when that cannot be decided in one pass or some value is not finite (check tensor by tensor)."""
        dtypes = {t.dtype for t in self.tensors.values()}
        if self.raw is None or len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            return None
        dtype = next(iter(dtypes))
        end = self.raw.numel() - (self.raw.numel() - self.data_start) % _SIZES[dtype]
        region = self.raw[self.data_start : end].view(dtype)
        if region.numel() == 0:
            return 0.0
        low, high = torch.aminmax(region)  # NaN propagates into both
        largest = max(abs(float(low)), abs(float(high)))
        return largest if math.isfinite(largest) else None


def read_adapter_file(lora_dir: Path, lora_name: str) -> AdapterFile:
    """The adapter's tensors from the first weights file present, read without running code."""
    weight_file = next((lora_dir / f for f in WEIGHT_FILES if (lora_dir / f).is_file()), None)
    if weight_file is None:
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': no weights file ({', '.join(WEIGHT_FILES)}) in {str(lora_dir)!r}"
        )
    try:
        if weight_file.suffix == ".safetensors":
            adapter = _read_safetensors(weight_file, lora_name)
        else:
            tensors = torch.load(str(weight_file), map_location="cpu", weights_only=True)
            adapter = AdapterFile(lora_name, weight_file, tensors)
    except Exception as e:  # any parse failure (bad pickle, corrupt zip/header) is the adapter's fault
        reason = re.sub(r"0x[0-9a-fA-F]+", "0x?", str(e).strip().splitlines()[0] if str(e).strip() else "")
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': cannot load {weight_file.name} safely "
            f"({type(e).__name__}: {reason[:300]})"
        ) from None
    if not isinstance(adapter.tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in adapter.tensors.items()
    ):
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': {weight_file.name} is not a mapping of names to tensors"
        )
    return adapter


def _read_safetensors(path: Path, lora_name: str) -> AdapterFile:
    with open(path, "rb") as f:
        fd = f.fileno()
        # torch.empty, not bytearray: no zero-fill before the reads overwrite it.
        raw = torch.empty(os.fstat(fd).st_size, dtype=torch.uint8)
        buffer = raw.numpy()
        if raw.numel() < 8:
            raise ValueError("file too short for a safetensors header")
        _pread_into(fd, buffer[:8], 0)
        data_start = 8 + min(int.from_bytes(buffer[:8].tobytes(), "little"), raw.numel() - 8)
        _pread_into(fd, buffer[8:data_start], 8)
        header = _parse_header(raw)
        halves = _name_order_halves(header) if header is not None else None
        if header is None or halves is None:
            _pread_into(fd, buffer[data_start:], data_start)
            if header is None:  # valid, but not for the zero-copy path: let the library decide
                return AdapterFile(lora_name, path, safetensors.torch.load(buffer.tobytes()))
            parts = None
        else:
            # Two threads read and hash the two halves in parallel; the views are built meanwhile.
            parts = [_read_and_hash(fd, buffer, data_start + lo, data_start + hi) for lo, hi in halves]
        try:
            tensors = _views(raw, header, data_start)
        finally:
            _wait_all_loaded(parts or [])  # before the file closes, and before anyone reads the data
    return AdapterFile(lora_name, path, tensors, raw, data_start, parts)


def _wait_all_loaded(parts: list[HashPart]) -> None:
    """Wait for every read (none may still use the file after this), then raise the first error."""
    errors: list[BaseException] = []
    for part in parts:
        try:
            part.wait_loaded()
        except BaseException as e:  # noqa: BLE001 - raised below, once all reads are over
            errors.append(e)
    if errors:
        raise errors[0]


def _views(raw: torch.Tensor, header: dict[str, tuple[torch.dtype, list[int], int, int]],
           data_start: int) -> dict[str, torch.Tensor]:
    """One typed view of the data per dtype, then one `as_strided` per tensor."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, (dtype, shape, begin, _) in header.items():
        size = _SIZES[dtype]
        if dtype not in typed:
            end = raw.numel() - (raw.numel() - data_start) % size
            typed[dtype] = raw[data_start:end].view(dtype)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        view = typed[dtype]  # as_strided's offset counts from the storage start, not from the view's
        tensors[key] = view.as_strided(shape, strides, view.storage_offset() + begin // size)
    return tensors


def _name_order_halves(header: dict[str, tuple[torch.dtype, list[int], int, int]]) -> list[tuple[int, int]] | None:
    """Byte ranges (in the data region) of the tensors of each half of the names, in name order, when
    the file stores them back to back in that order (safetensors does for one dtype); else None."""
    keys = sorted(header)
    spans = [(header[k][2], header[k][2] + header[k][3] * _SIZES[header[k][0]]) for k in keys]
    if not spans or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return None
    half = len(spans) // 2
    middle = spans[half][0]
    return [(spans[0][0], middle), (middle, spans[-1][1])]


def _read_and_hash(fd: int, buffer: Any, begin: int, end: int) -> HashPart:
    view = buffer[begin:end]
    return HashPart(lambda: [view.data], read=lambda: _pread_into(fd, view, begin))


def _pread_into(fd: int, view: Any, offset: int) -> None:
    """Fill the numpy byte `view` from the file at `offset` (the GIL is released during the read)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError("the file is shorter than its header says")
        done += got


def _parse_header(raw: torch.Tensor) -> dict[str, tuple[torch.dtype, list[int], int, int]] | None:
    """key -> (dtype, shape, byte offset in the data region, element count), every entry checked to lie
    inside the file; None when some entry needs the library (unknown dtype, unaligned, empty)."""
    if raw.numel() < 8:
        raise ValueError("file too short for a safetensors header")
    header_len = int.from_bytes(raw[:8].numpy().tobytes(), "little")
    if header_len > min(_MAX_HEADER, raw.numel() - 8):
        raise ValueError("safetensors header length is out of range")
    header = json.loads(raw[8 : 8 + header_len].numpy().tobytes())
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    data_len = raw.numel() - 8 - header_len
    entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            return None
        dtype, shape, offsets = _DTYPES.get(info.get("dtype", "")), info.get("shape"), info.get("data_offsets")
        if dtype is None or not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2 \
                or len(shape) > _MAX_DIMS:
            return None
        begin, end = offsets
        size, count = _SIZES[dtype], math.prod(shape)
        if not 0 <= begin <= end <= data_len or end - begin != count * size:
            raise ValueError(f"tensor {key!r} lies outside the file or does not match its shape")
        if count == 0 or (8 + header_len) % size or begin % size:
            return None
        entries[key] = (dtype, shape, begin, count)
    # Like the library: the tensors must tile the data region exactly (no overlaps, no gaps, nothing
    # after), so no tensor aliases another and the buffer holds nothing the adapter does not use.
    spans = sorted((begin, begin + count * _SIZES[dtype]) for dtype, _, begin, count in entries.values())
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and (spans[0][0], spans[-1][1]) != (0, data_len)):
        return None
    return entries


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value)
