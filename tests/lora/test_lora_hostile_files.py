"""Hostile adapter files cost a stat and a few bytes, not a full read: the safetensors header is checked
before any data, a weights file larger than any valid adapter is refused by its size, and a broken adapter
is remembered by its files' identity (the same bytes fail fast, fixed files are read again). Also what a
registered adapter's requests get when its files vanish or change after the host cache evicted it."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from support.stand_in_model import INTER, KV, H, StandInLlama, stand_in_tensors, write_stand_in_adapter

from loraserve.config import LoRAConfig
from loraserve.errors import LoRAAdapterChangedError, LoRAAdapterError, LoRAAdapterGoneError
from loraserve.lora.checkpoint import read_adapter_file
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest

TWO_GIB = 2 << 30


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Bytes read through os.pread / os.preadv from now on (how the weights readers read files)."""
    total = [0]
    pread, preadv = os.pread, os.preadv

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        data = pread(fd, length, offset)
        total[0] += len(data)
        return data

    def counting_preadv(fd: int, buffers: list, offset: int) -> int:
        got = preadv(fd, buffers, offset)
        total[0] += got
        return got

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    return lambda: total[0]


def _sparse_weights(folder: Path, head: bytes, size: int = TWO_GIB) -> Path:
    """adapter_model.safetensors starting with `head`, then holes up to `size` bytes (no disk used)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "adapter_model.safetensors"
    path.write_bytes(head)
    os.truncate(path, size)
    return folder


def _header(entries: dict) -> bytes:
    text = json.dumps(entries).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("zeros", "header length is out of range"),  # `truncate -s 2G`
        ("huge_header_length", "header length is out of range"),  # a sane-looking length, then garbage
        ("garbage_header", "not valid JSON"),
        ("data_beyond_header", "more data than its header describes"),  # a valid header, then 2 GB
    ],
)
def test_huge_sparse_file_is_refused_after_reading_its_header_only(
    tmp_path: Path, bytes_read: Callable[[], int], case: str, reason: str
) -> None:
    tensor = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    head = {
        "zeros": b"",
        "huge_header_length": struct.pack("<Q", 50 << 20) + b"\xff" * 64,
        "garbage_header": struct.pack("<Q", 64) + b"\xff" * 64,
        "data_beyond_header": _header(tensor) + b"\0" * 8,
    }[case]
    folder = _sparse_weights(tmp_path / case, head)
    with pytest.raises(LoRAAdapterError, match=f"'{case}': cannot load adapter_model.safetensors safely") as info:
        read_adapter_file(folder, case)
    assert bytes_read() <= 4096
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("entries", "data_len", "reason"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlap or leave gaps"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16, "overlap or leave gaps"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "shorter than its header says"),
        ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, 8, "unsupported dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"k": 1}}, 8,
         "__metadata__"),
    ],
    ids=["overlap", "gap", "short", "dtype", "metadata"],
)
def test_headers_that_do_not_describe_the_file_exactly_are_refused_before_the_data(
    tmp_path: Path, bytes_read: Callable[[], int], entries: dict, data_len: int, reason: str
) -> None:
    head = _header(entries)
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(head + b"\0" * data_len)
    with pytest.raises(LoRAAdapterError, match="'a': cannot load adapter_model.safetensors safely") as info:
        read_adapter_file(folder, "a")
    assert bytes_read() == len(head)  # the header, and not one byte of data
    assert reason in str(info.value)


def _manager(max_loras: int = 1, max_cpu_loras: int = 1) -> LoRAManager:
    config = LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=8)
    return LoRAManager(StandInLlama(), config, torch.float32, "cpu")


def test_weights_file_larger_than_any_valid_adapter_is_refused_unread(
    tmp_path: Path, bytes_read: Callable[[], int]
) -> None:
    manager = _manager()
    folder = write_stand_in_adapter(tmp_path / "huge", 1)
    head = _header({"w": {"dtype": "U8", "shape": [TWO_GIB], "data_offsets": [0, TWO_GIB]}})
    _sparse_weights(folder, head, len(head) + TWO_GIB)  # a valid header for 2 GB: only the size gives it away
    with pytest.raises(LoRAAdapterError, match="'huge': adapter_model.safetensors is .* bytes, more than any "
                       "LoRA adapter for this model and max_lora_rank can hold"):
        manager.register(LoRARequest("huge", 1, str(folder)))
    assert bytes_read() == 0
    # The bound leaves room for the largest valid adapter: every module and slice at the maximum rank, in
    # float64, .bin format (a pickle with its framing).
    big = {}
    for layer in range(2):
        for module, d_in, d_out in (("self_attn.q_proj", H, H), ("self_attn.k_proj", H, KV),
                                    ("self_attn.v_proj", H, KV), ("self_attn.o_proj", H, H),
                                    ("mlp.gate_proj", H, INTER), ("mlp.up_proj", H, INTER),
                                    ("mlp.down_proj", INTER, H)):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            big[f"{prefix}.lora_A.weight"] = torch.randn(8, d_in, dtype=torch.float64) / 10
            big[f"{prefix}.lora_B.weight"] = torch.randn(d_out, 8, dtype=torch.float64) / 10
    folder = write_stand_in_adapter(tmp_path / "big", 2, r=8, target_modules="all-linear")
    (folder / "adapter_model.safetensors").unlink()
    torch.save(big, folder / "adapter_model.bin")
    manager.register(LoRARequest("big", 2, str(folder)))


def test_broken_adapter_fails_fast_until_its_files_change(tmp_path: Path, bytes_read: Callable[[], int]) -> None:
    manager = _manager()
    folder = write_stand_in_adapter(tmp_path / "broken", 1)
    tensors = stand_in_tensors(1)
    broken = {k.replace("q_proj", "nope_proj"): v for k, v in tensors.items()}
    safetensors.torch.save_file(broken, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="'broken'") as first:
        manager.register(LoRARequest("broken", 1, str(folder)))
    assert bytes_read() > 0
    read_before = bytes_read()
    for lora_id in (2, 3):  # a resolver gives every attempt a new id: the same name and files still match
        with pytest.raises(LoRAAdapterError) as again:
            manager.register(LoRARequest("broken", lora_id, str(folder)))
        assert str(again.value) == str(first.value) and type(again.value) is type(first.value)
    assert bytes_read() == read_before  # not read again
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))  # fixed: read again
    manager.register(LoRARequest("broken", 4, str(folder)))
    assert manager.is_registered(4)


def test_registered_adapter_whose_files_are_gone_fails_alone(tmp_path: Path) -> None:
    manager = _manager()
    gone, other = (write_stand_in_adapter(tmp_path / name, seed) for name, seed in (("gone", 1), ("other", 2)))
    manager.register(LoRARequest("gone", 1, str(gone)))
    manager.register(LoRARequest("other", 2, str(other)))  # evicts "gone" from the host cache
    shutil.rmtree(gone)
    slots, failed = manager.prepare_step({1})
    manager.end_step()
    assert slots == {} and isinstance(failed[1], LoRAAdapterGoneError)
    assert str(failed[1]) == (
        "LoRA adapter 'gone' is registered but its files are gone from disk; unload it, or put its files back."
    )
    slots, failed = manager.prepare_step({2})
    manager.end_step()
    assert failed == {} and 2 in slots


def test_registered_adapter_changed_on_disk_never_serves_the_new_weights(
    tmp_path: Path, bytes_read: Callable[[], int]
) -> None:
    manager = _manager()
    folder = write_stand_in_adapter(tmp_path / "c", 1)
    original = (folder / "adapter_model.safetensors").read_bytes()
    digest = manager.register(LoRARequest("c", 1, str(folder))).result()
    manager.register(LoRARequest("d", 2, str(write_stand_in_adapter(tmp_path / "d", 2))))  # evicts "c"
    safetensors.torch.save_file(stand_in_tensors(7), str(folder / "adapter_model.safetensors"))

    def step_error() -> Exception | None:
        slots, failed = manager.prepare_step({1})
        manager.end_step()
        return failed.get(1)

    error = step_error()
    assert isinstance(error, LoRAAdapterChangedError) and "'c' changed on disk since it was loaded" in str(error)
    read_before = bytes_read()
    assert str(step_error()) == str(error) and bytes_read() == read_before  # the same files fail fast
    (folder / "adapter_model.safetensors").write_bytes(b"garbage")
    assert "no longer loads" in str(step_error())
    (folder / "adapter_model.safetensors").write_bytes(original)  # the registered content is back
    assert step_error() is None
    # Serving the new weights takes an unload and a load: a new content identity (prefix-cache salt).
    safetensors.torch.save_file(stand_in_tensors(7), str(folder / "adapter_model.safetensors"))
    assert manager.remove(1, in_use=False)
    assert manager.register(LoRARequest("c", 1, str(folder)), explicit=True).result() != digest


def test_failed_loads_under_a_home_path_are_retried_once_fixed(tmp_path, monkeypatch) -> None:
    """A `~/...` adapter is fingerprinted at its real folder: fixing its files lets the next load read
    them again (keyed on the raw path, every fingerprint was 'missing' and the error stuck forever)."""
    import loraserve.lora.adapter_loader as loader_module

    monkeypatch.setenv("HOME", str(tmp_path))
    folder = write_stand_in_adapter(tmp_path / "ad", 1)
    config = folder / "adapter_config.json"
    good_config = config.read_text()
    config.write_text("{broken")
    reads: list[str] = []
    real_read = loader_module.read_adapter

    def counting_read(folder: str, *args: object) -> object:
        reads.append(folder)
        return real_read(folder, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(loader_module, "read_adapter", counting_read)
    manager = LoRAManager(StandInLlama(), LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=8),
                          torch.float32, "cpu")  # fmt: skip
    request = LoRARequest("ad", 1, "~/ad")
    for _ in range(2):
        with pytest.raises(LoRAAdapterError, match="not valid JSON"):
            manager.register(request)
    assert reads == [str(folder)]  # the real folder; the second failure came from memory
    config.write_text(good_config)
    os.utime(config, ns=(1, 1))  # a new mtime even on a coarse clock
    manager.register(request)
    assert len(reads) == 2 and manager.is_registered(1)


def test_hub_ids_not_downloaded_are_not_remembered(tmp_path, monkeypatch) -> None:
    """A failure before any local files exist (a Hub download that failed) is retried next time."""
    import loraserve.lora.adapter_path as adapter_path

    monkeypatch.chdir(tmp_path)
    calls: list[str] = []

    def failing_download(repo_id: str, subfolder: str, lora_path: str, lora_name: str) -> str:
        calls.append(repo_id)
        raise LoRAAdapterError(f"LoRA adapter '{lora_name}': downloading failed")

    monkeypatch.setattr(adapter_path, "_download", failing_download)
    manager = LoRAManager(StandInLlama(), LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=8),
                          torch.float32, "cpu")  # fmt: skip
    for _ in range(3):
        with pytest.raises(LoRAAdapterError, match="downloading failed"):
            manager.register(LoRARequest("hub", 2, "some-org/some-adapter"))
    assert calls == ["some-org/some-adapter"] * 3
