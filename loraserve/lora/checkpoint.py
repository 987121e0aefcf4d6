"""Reading an adapter's weights file: tensors, a content digest and a range check, fast.

A cold adapter's first request waits for all of this. In the common case (one safetensors file of
one float dtype, tensors stored in name order) two threads read the two halves of the data into one
uninitialised buffer and hash them (`digest.py`; the GIL is released for both), while this thread
builds the tensors as views of that buffer: one typed view per dtype, one `as_strided` per tensor.
Values are range-checked (finite, no overflow once scaled) with one min/max over the data region.
Per-tensor torch ops cost ~5-20 us each on a small CPU and an all-7-projection adapter of a 30-layer
model has 420 tensors, hence the care. Anything unusual (unaligned offsets, exotic dtypes, empty
tensors) goes through the safetensors library; `.bin` / `.pt` files load with
`torch.load(weights_only=True)`. Nothing is read before the file is known to be a regular file no
larger than a valid adapter could be, and, for safetensors, before its header is known to describe
the file exactly (`safetensors_header.py`): a huge or garbage file costs a stat and a few bytes.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy
import safetensors.torch
import torch

from loraserve.errors import LoRAAdapterError
from loraserve.lora.digest import HashPart, PendingDigest
from loraserve.lora.safetensors_header import TORCH_DTYPES, FastLayout, read_header

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
_SIZES = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in TORCH_DTYPES.values()}
_PATH = re.compile(r"(?<![\w.])/[^\s'\"]+")  # an absolute path in a library's message


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

    def tensors_in(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors in `dtype`: when the file holds one float dtype, converted with one op over the
        whole data region (views of the result), not one op per tensor (420 for a 30-layer model on all
        7 projections); otherwise tensor by tensor."""
        region = self._region()
        if region is not None and region.dtype == dtype:
            return dict(self.tensors)
        if region is None or not dtype.is_floating_point:
            return {k: t.to(dtype) if t.is_floating_point() else t for k, t in self.tensors.items()}
        converted = region.to(dtype)
        base = region.storage_offset()
        return {k: converted.as_strided(t.shape, t.stride(), t.storage_offset() - base)
                for k, t in self.tensors.items()}

    def _region(self) -> torch.Tensor | None:
        """The data region as one tensor of the file's single float dtype; None when there is none."""
        dtypes = {t.dtype for t in self.tensors.values()}
        if self.raw is None or len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            return None
        dtype = next(iter(dtypes))
        end = self.raw.numel() - (self.raw.numel() - self.data_start) % _SIZES[dtype]
        return self.raw[self.data_start : end].view(dtype)

    def max_abs(self) -> float | None:
        """The largest |value| of all tensors, in one pass when the file holds one float dtype; None
        when that cannot be decided in one pass or some value is not finite (check tensor by tensor)."""
        region = self._region()
        if region is None:
            return None
        if region.numel() == 0:
            return 0.0
        low, high = torch.aminmax(region)  # NaN propagates into both
        largest = max(abs(float(low)), abs(float(high)))
        return largest if math.isfinite(largest) else None


def read_adapter_file(lora_dir: Path, lora_name: str, max_bytes: int | None = None) -> AdapterFile:
    """The adapter's tensors from the first weights file present, read without running code.

    The file must be a regular file of at most `max_bytes` (the most a valid adapter could hold), both
    checked on the open descriptor before anything is read; a safetensors header must describe the
    file exactly before any data is read (`safetensors_header.py`). Messages name the adapter and the
    file, never the folder (a server path)."""
    name = next((f for f in WEIGHT_FILES if os.path.lexists(lora_dir / f)), None)
    if name is None:
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': no weights file ({', '.join(WEIGHT_FILES)}) in its folder"
        )
    weight_file = lora_dir / name
    with _open_regular(weight_file, lora_name) as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': {name} is {size} bytes, more than any LoRA adapter for this "
                f"model and max_lora_rank can hold ({max_bytes} bytes at most)"
            )
        try:
            if weight_file.suffix == ".safetensors":
                adapter = _read_safetensors(f.fileno(), size, weight_file, lora_name)
            else:
                adapter = AdapterFile(lora_name, weight_file, torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # any parse failure (bad pickle, corrupt zip/header) is the adapter's fault
            raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {_load_failure(name, e)}") from None
    if not isinstance(adapter.tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in adapter.tensors.items()
    ):
        raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {name} is not a mapping of names to tensors")
    return adapter


def _open_regular(path: Path, lora_name: str) -> BinaryIO:
    """`path` open for reading, if it is a regular file: a FIFO or a device (a symlink to /dev/zero)
    can neither block the caller nor feed it endless bytes. Opened non-blocking, checked by fstat."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise LoRAAdapterError(f"LoRA adapter '{lora_name}': cannot open {path.name} ({e.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {path.name} is not a regular file")
    return f


def _load_failure(file_name: str, e: Exception) -> str:
    """Why a weights file could not be loaded, without torch's advice to load it unsafely (its
    weights_only refusals say to retry with weights_only=False), memory addresses or file paths."""
    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        return f"{file_name} holds objects that safe loading refuses, or is not a PyTorch checkpoint of tensors"
    reason = text.splitlines()[0] if text else ""
    reason = _PATH.sub("<path>", re.sub(r"0x[0-9a-fA-F]+", "0x?", reason))
    if "weights_only" in reason:
        reason = ""
    return f"cannot load {file_name} safely ({type(e).__name__}{': ' + reason[:300] if reason else ''})"


def _read_safetensors(fd: int, size: int, path: Path, lora_name: str) -> AdapterFile:
    header = read_header(fd, size)  # checked before any data is read (or any buffer allocated)
    layout = header.fast_layout()
    data_start = header.data_start
    # torch.empty, not bytearray: no zero-fill before the reads overwrite it.
    raw = torch.empty(size, dtype=torch.uint8)
    buffer = raw.numpy()
    buffer[:data_start] = numpy.frombuffer(header.raw, dtype=numpy.uint8)
    halves = _name_order_halves(layout) if layout is not None else None
    if layout is None or halves is None:
        _pread_into(fd, buffer[data_start:], data_start)
        if layout is None:  # valid, but not for the zero-copy path: let the library decide
            return AdapterFile(lora_name, path, safetensors.torch.load(buffer.tobytes()))
        parts = None
    else:
        # Two threads read and hash the two halves in parallel; the views are built meanwhile.
        parts = [_read_and_hash(fd, buffer, data_start + lo, data_start + hi) for lo, hi in halves]
    try:
        tensors = _views(raw, layout, data_start)
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


def _views(raw: torch.Tensor, header: FastLayout, data_start: int) -> dict[str, torch.Tensor]:
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


def _name_order_halves(header: FastLayout) -> list[tuple[int, int]] | None:
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
