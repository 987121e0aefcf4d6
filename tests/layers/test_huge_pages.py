"""huge_pages.zeros: zero-filled tensors of the asked shapes and dtypes, apart from each other, on memory
advised for huge pages (Linux), alive as long as any of them is; plain tensors when switched off; with
huge=False (the KV cache) on plain pages, committed only as they are written, whatever the switch."""

from __future__ import annotations

import gc
import mmap
import resource
import sys

import pytest
import torch

from loraserve.native import huge_pages

SPECS = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((0, 4), torch.float32), ((1000, 333), torch.bfloat16),
         ((2, 3, 4), torch.int32)]


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (Linux)."""
    current: tuple[int, int] | None = None
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            first = line.split(" ", 1)[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                current = (lo, hi)
            elif line.startswith("VmFlags:") and current is not None and current[0] <= address < current[1]:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("touch", [False, True])
def test_tensors_are_zeroed_apart_and_aligned(touch: bool) -> None:
    tensors = huge_pages.zeros(SPECS, "cpu", touch=touch)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == SPECS
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % huge_pages.ALIGN == 0 and not t.any()
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):  # no tensor wrote into another
        assert bool((t == i + 1).all())


def _has_thp() -> bool:
    """Linux with transparent huge pages offered, and smaps reporting VmFlags (not every sandbox does)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            offered = "[never]" not in f.read()
        with open("/proc/self/smaps", encoding="ascii") as smaps:
            return offered and any(line.startswith("VmFlags:") for line in smaps)
    except OSError:
        return False


@pytest.mark.skipif(not _has_thp(), reason="needs Linux transparent huge pages")
def test_memory_is_advised_for_huge_pages_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    big = huge_pages.zeros([((4 << 20,), torch.uint8)], "cpu")[0]
    assert "hg" in _vm_flags(big.data_ptr())
    monkeypatch.setenv("LORASERVE_CPU_HUGE_PAGES", "0")
    plain = huge_pages.zeros([((4 << 20,), torch.uint8)], "cpu")[0]
    assert not plain.any() and "hg" not in _vm_flags(plain.data_ptr())


def test_views_keep_their_memory_alive() -> None:
    view = huge_pages.zeros([((64,), torch.float32), ((1 << 20,), torch.float32)], "cpu")[1][5:9]
    gc.collect()
    view.copy_(torch.arange(4.0))
    huge_pages.zeros([((1 << 20,), torch.float32)], "cpu")[0].fill_(-1.0)  # another mapping, maybe the same place
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_an_empty_request_and_other_devices_get_plain_tensors() -> None:
    assert huge_pages.zeros([], "cpu") == []
    (empty,) = huge_pages.zeros([((0,), torch.float32)], "cpu")
    assert empty.shape == (0,)
    (meta,) = huge_pages.zeros([((2, 2), torch.float32)], "meta")
    assert meta.device.type == "meta" and meta.shape == (2, 2)


def test_each_tensor_owns_its_bytes() -> None:
    """Saving or sharing one tensor must not take the others' memory along."""
    small, big = huge_pages.zeros([((16,), torch.float32), ((1 << 20,), torch.float32)], "cpu")
    assert small.untyped_storage().nbytes() == 64 and big.untyped_storage().nbytes() == 4 << 20


def test_without_a_mapping_the_tensors_are_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no memory for the mapping")

    monkeypatch.setattr(mmap, "mmap", refuse)
    tensors = huge_pages.zeros(SPECS, "cpu", touch=True)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == SPECS and not any(t.any() for t in tensors)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_plain_pages_cost_only_what_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_CPU_HUGE_PAGES", "0")  # huge=False maps lazily whatever the switch
    before = _rss_bytes()
    k, v = huge_pages.zeros([((1 << 27,), torch.float32)] * 2, "cpu", huge=False)  # 2 x 512 MiB
    untouched = _rss_bytes() - before
    assert "hg" not in _vm_flags(k.data_ptr()) and not k[-16:].any() and not v[:16].any()
    k[: 1 << 22].fill_(1.0)  # 16 MiB written
    written = _rss_bytes() - before
    assert untouched < 8 << 20, untouched
    assert 16 << 20 <= written < 64 << 20, written
    assert k[(1 << 22) - 1].item() == 1.0 and k[1 << 22].item() == 0.0 and not v.any()
