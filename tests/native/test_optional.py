"""Optional Triton backends: a module that imports is returned, a missing dependency is None without a
word, a broken one is None with one warning, and each is tried once per process."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.native.optional import triton_module


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Three importable names under a fresh prefix: one fine, one missing a dependency, one broken."""
    prefix = f"optional_probe_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{prefix}_ok.py").write_text("VALUE = 3\n")
    (tmp_path / f"{prefix}_missing.py").write_text("import no_such_dependency_for_this_test\n")
    (tmp_path / f"{prefix}_broken.py").write_text("COUNT = 1\nraise RuntimeError('no GPU backend')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield prefix
    for suffix in ("ok", "missing", "broken"):
        sys.modules.pop(f"{prefix}_{suffix}", None)


def test_an_importable_module_is_returned(modules: str) -> None:
    module = triton_module(f"{modules}_ok")
    assert module is not None and module.VALUE == 3
    assert triton_module(f"{modules}_ok") is module


def test_a_missing_dependency_is_none_and_silent(modules: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert triton_module(f"{modules}_missing") is None
    assert caplog.records == []


def test_a_broken_module_is_none_with_one_warning(modules: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert triton_module(f"{modules}_broken") is None
        assert triton_module(f"{modules}_broken") is None  # not retried, not logged again
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no GPU backend" in warnings[0].getMessage()
