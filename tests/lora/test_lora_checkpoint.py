"""Adapter weights files: the zero-copy safetensors reader against the library, digests, finiteness."""

from __future__ import annotations

import gc
import json
import struct
import weakref
from pathlib import Path

import pytest
import safetensors.torch
import torch

from loraserve.errors import LoRAAdapterError
from loraserve.lora import digest
from loraserve.lora.checkpoint import AdapterFile, read_adapter_file


def _tensors(seed: int = 0, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(6):
        dtype = dtypes[i % len(dtypes)]
        out[f"base_model.model.layers.{i}.q_proj.lora_A.weight"] = torch.randn(3, 5 + i, generator=g).to(dtype)
        out[f"base_model.model.layers.{i}.q_proj.lora_B.weight"] = torch.randn(7, 3, generator=g).to(dtype)
    return out


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.float16)],
                         ids=["f32", "bf16", "mixed"])
def test_zero_copy_reader_equals_the_library(tmp_path: Path, dtypes: tuple[torch.dtype, ...]) -> None:
    folder = _save(tmp_path / "a", _tensors(1, dtypes))
    adapter = read_adapter_file(folder, "a")
    expected = safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))
    assert adapter.raw is not None  # the fast path was taken
    if len(dtypes) == 1:  # name order is byte order: two threads read and hash the halves
        assert adapter.hash_parts is not None and len(adapter.hash_parts) == 2
    assert adapter.tensors.keys() == expected.keys()
    for key, tensor in expected.items():
        assert adapter.tensors[key].dtype == tensor.dtype and torch.equal(adapter.tensors[key], tensor), key


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.float16)],
                         ids=["f32", "bf16", "mixed"])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_in_a_dtype_equal_converting_each(tmp_path: Path, dtypes: tuple[torch.dtype, ...],
                                                  target: torch.dtype) -> None:
    """One conversion over the data region gives exactly what converting each tensor gives."""
    folder = _save(tmp_path / "a", _tensors(2, dtypes))
    adapter = read_adapter_file(folder, "a")
    converted = adapter.tensors_in(target)
    assert converted.keys() == adapter.tensors.keys()
    for key, tensor in adapter.tensors.items():
        assert converted[key].dtype == target and converted[key].shape == tensor.shape, key
        assert torch.equal(converted[key], tensor.to(target)), key


def test_digest_is_content_defined(tmp_path: Path) -> None:
    tensors = _tensors(2)
    fast = read_adapter_file(_save(tmp_path / "a", tensors), "a")
    # Same content through another format and another reading path: same digest.
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / "adapter_model.bin")
    assert read_adapter_file(tmp_path / "bin", "b").digest("{}") == fast.digest("{}")
    assert AdapterFile("c", tmp_path, dict(tensors)).digest("{}") == fast.digest("{}")
    # Any change in a value, a name, the dtype or the config changes it.
    changed = dict(tensors)
    key = next(iter(changed))
    changed[key] = changed[key].clone()
    changed[key][0, 0] += 1e-3
    assert AdapterFile("c", tmp_path, changed).digest("{}") != fast.digest("{}")
    renamed = {k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()}
    assert AdapterFile("c", tmp_path, renamed).digest("{}") != fast.digest("{}")
    as_double = {k: v.double() for k, v in tensors.items()}
    assert AdapterFile("c", tmp_path, as_double).digest("{}") != fast.digest("{}")
    assert fast.digest('{"r": 4}') != fast.digest("{}")


def test_max_abs(tmp_path: Path) -> None:
    tensors = _tensors(3)
    expected = max(float(t.abs().max()) for t in tensors.values())
    assert read_adapter_file(_save(tmp_path / "ok", tensors), "ok").max_abs() == expected
    bad = dict(tensors)
    key = sorted(bad)[-1]
    bad[key] = bad[key].clone()
    bad[key][-1, -1] = float("nan")
    assert read_adapter_file(_save(tmp_path / "nan", bad), "nan").max_abs() is None
    bad[key][-1, -1] = float("-inf")
    assert read_adapter_file(_save(tmp_path / "inf", bad), "inf").max_abs() is None
    # Several dtypes: not decided in one pass, the caller checks tensor by tensor.
    assert read_adapter_file(_save(tmp_path / "mixed", _tensors(3, (torch.float32, torch.float16))),
                             "mixed").max_abs() is None


def _write_raw(folder: Path, header: dict, data: bytes, pad_header: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(header).encode()
    if pad_header:
        text += b" " * (-len(text) % 8)
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    return folder


@pytest.mark.parametrize("case", ["offsets_outside", "shape_mismatch", "header_too_long", "not_object",
                                  "truncated"])
def test_corrupt_files_are_refused(tmp_path: Path, case: str) -> None:
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    entry = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    folder = tmp_path / case
    if case == "offsets_outside":
        _write_raw(folder, {"w": {**entry, "data_offsets": [0, 48]}}, data)
    elif case == "shape_mismatch":
        _write_raw(folder, {"w": {**entry, "shape": [4, 3]}}, data)
    elif case == "header_too_long":
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    elif case == "not_object":
        _write_raw(folder, [1, 2], data)  # type: ignore[arg-type]
    else:
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LoRAAdapterError, match=f"'{case}': cannot load adapter_model.safetensors safely"):
        read_adapter_file(folder, case)


def test_unusual_files_go_through_the_library(tmp_path: Path) -> None:
    # An unaligned header (legal for the format, not for a typed view) and a zero-size tensor.
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    header = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "e": {"dtype": "F32", "shape": [0], "data_offsets": [24, 24]}}
    folder = _write_raw(tmp_path / "u", header, data, pad_header=False)
    adapter = read_adapter_file(folder, "u")
    assert adapter.raw is None  # the library read it
    assert torch.equal(adapter.tensors["w"], torch.arange(6, dtype=torch.float32).view(2, 3))
    assert adapter.tensors["e"].numel() == 0


def test_digest_errors_reach_the_caller(tmp_path: Path) -> None:
    adapter = AdapterFile("a", tmp_path, _tensors(4))

    def boom() -> bytes:
        raise RuntimeError("disk on fire")

    pending = digest.PendingDigest(__import__("hashlib").sha256(), [digest.HashPart(lambda: [boom()])])
    with pytest.raises(RuntimeError, match="disk on fire"):
        pending.result()
    assert len(adapter.start_digest("{}").result()) == 64


def test_a_finished_digest_keeps_no_bytes_alive(tmp_path: Path) -> None:
    """The registry keeps an adapter's digest while it is registered: the digest must not keep the
    adapter's file buffer (and so every evicted adapter) in memory."""
    adapter = read_adapter_file(_save(tmp_path / "a", _tensors(3)), "a")
    assert adapter.raw is not None
    pending = adapter.start_digest("{}")
    digest = pending.result()
    raw = weakref.ref(adapter.raw)
    del adapter
    gc.collect()
    assert raw() is None and pending.result() == digest
