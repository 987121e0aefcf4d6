"""Reading an adapter's weights file: tensors, a content digest and a finiteness check, fast.

A cold adapter's first request waits for all of this, so the common case (one safetensors file of one
float dtype) is read with one `readinto` and parsed without copying: every tensor is a view into the
file's bytes, the digest hashes those bytes on two threads (GIL released, beside the parsing), and
the values are range-checked (finite, no overflow once scaled) with one min/max over the data region. Per-tensor torch ops cost ~5-20 us each on a small
CPU, and an all-7-projection adapter of a 30-layer model has 420 tensors, so they are kept to one per
tensor. Anything unusual (unaligned offsets, exotic dtypes) goes through the safetensors library;
`.bin` / `.pt` files load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import safetensors.torch
import torch

from loraserve.errors import LoRAAdapterError

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
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> [begin, end) in `raw`

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
        return PendingDigest(prefix, [self._hash_part(keys[:half]), self._hash_part(keys[half:])])

    def _hash_part(self, keys: list[str]) -> Callable[[], bytes]:
        spans = [self.spans.get(k) for k in keys]
        if self.raw is not None and keys and all(spans) and all(
            a[1] == b[0] for a, b in zip(spans, spans[1:])  # type: ignore[index]
        ):
            raw = self.raw.numpy().data[spans[0][0] : spans[-1][1]]  # type: ignore[index]
            return lambda: hashlib.sha256(raw).digest()
        tensors = [self.tensors[k].detach().contiguous().cpu() for k in keys]

        def hash_tensors() -> bytes:
            h = hashlib.sha256()
            for t in tensors:
                h.update(t.reshape(-1).view(torch.uint8).numpy().data)
            return h.digest()

        return hash_tensors

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


class PendingDigest:
    """A digest whose parts are being hashed on background threads."""

    def __init__(self, prefix: hashlib._Hash, parts: list[Callable[[], bytes]]) -> None:
        self._prefix = prefix
        self._results: list[bytes | BaseException | None] = [None] * len(parts)
        self._threads = [threading.Thread(target=self._run, args=(i, part), daemon=True)
                         for i, part in enumerate(parts)]
        self._digest: str | None = None
        self._lock = threading.Lock()  # result() may be called from several threads
        for thread in self._threads:
            thread.start()

    def _run(self, index: int, part: Callable[[], bytes]) -> None:
        try:
            self._results[index] = part()
        except BaseException as e:  # noqa: BLE001 - re-raised by result() in the caller's thread
            self._results[index] = e

    def result(self) -> str:
        with self._lock:
            if self._digest is None:
                for thread in self._threads:
                    thread.join()
                h = self._prefix.copy()
                for part in self._results:
                    if isinstance(part, BaseException):
                        raise part
                    assert part is not None
                    h.update(part)
                self._digest = h.hexdigest()
            return self._digest


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
        # torch.empty, not bytearray: no 20 MB zero-fill before the read overwrites it.
        raw = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        if f.readinto(raw.numpy().data) != raw.numel():
            raise ValueError("short read")
    header = _parse_header(raw)
    if header is None:  # valid, but not for the zero-copy path: let the library decide
        return AdapterFile(lora_name, path, safetensors.torch.load(raw.numpy().tobytes()))
    data_start = 8 + int.from_bytes(raw[:8].numpy().tobytes(), "little")
    typed: dict[torch.dtype, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    spans: dict[str, tuple[int, int]] = {}
    for key, (dtype, shape, begin, count) in header.items():
        size = _SIZES[dtype]
        if dtype not in typed:  # one typed view of the data per dtype; a tensor is then one op
            end = raw.numel() - (raw.numel() - data_start) % size
            typed[dtype] = raw[data_start:end].view(dtype)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        view = typed[dtype]  # as_strided's offset counts from the storage start, not from the view's
        tensors[key] = view.as_strided(shape, strides, view.storage_offset() + begin // size)
        spans[key] = (data_start + begin, data_start + begin + count * size)
    return AdapterFile(lora_name, path, tensors, raw, data_start, spans)


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
