"""Cache folders published whole (model_loader/staging.py): a concurrent winner stands, a half folder is
replaced, everything staged reaches the disk before the rename, and staging folders left by a crash
are swept when a new one is staged, never one whose process still runs or that was touched lately."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loraserve.model_loader.staging import STALE_AFTER_S, publish, stage

NEVER_A_PID = 4194305  # above PID_MAX_LIMIT (2**22): no process can have it


def test_publishing_a_cache_folder_tolerates_a_concurrent_winner_and_replaces_half_folders(tmp_path: Path) -> None:
    def staged(name: str, content: str) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "data").write_text(content)
        (folder / "DONE").write_text("")
        return str(folder)

    target = str(tmp_path / "entry")
    publish(staged("first", "first"), target, "DONE")
    publish(staged("second", "second"), target, "DONE")  # another process won: theirs stands, no error
    assert (tmp_path / "entry" / "data").read_text() == "first"
    os.remove(os.path.join(target, "DONE"))  # a half folder, as a crash during a copy would leave
    publish(staged("third", "third"), target, "DONE")
    assert (tmp_path / "entry" / "data").read_text() == "third"


def _leftover(parent: Path, name: str, age_s: float) -> Path:
    """A staging folder with a file in it, everything last modified `age_s` ago."""
    folder = parent / name
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "model.safetensors").write_bytes(b"half written")
    when = time.time() - age_s
    for path in (folder / "sub" / "model.safetensors", folder / "sub", folder):
        os.utime(path, (when, when))
    return folder


def test_staging_sweeps_only_stale_ownerless_leftovers(tmp_path: Path) -> None:
    old = STALE_AFTER_S + 60
    crashed = _leftover(tmp_path, f".convert-{NEVER_A_PID}-abc", old)
    legacy = _leftover(tmp_path, ".convert-k2j4h1", old)  # no pid in the name (older releases)
    running = _leftover(tmp_path, f".convert-{os.getpid()}-def", old)  # its process is alive
    recent = _leftover(tmp_path, f".convert-{NEVER_A_PID}-ghi", 60)  # touched a minute ago
    other_kind = _leftover(tmp_path, f".train-{NEVER_A_PID}-jkl", old)
    published = _leftover(tmp_path, "0123abcd", old)
    touched = _leftover(tmp_path, f".convert-{NEVER_A_PID}-mno", old)
    os.utime(touched / "sub" / "model.safetensors")  # a build still writing deep inside
    new = Path(stage(str(tmp_path), ".convert-"))
    assert new.is_dir() and new.name.startswith(f".convert-{os.getpid()}-") and not any(new.iterdir())
    assert not crashed.exists() and not legacy.exists()
    assert all(p.exists() for p in (running, recent, other_kind, published, touched))


def test_publish_flushes_every_staged_file_and_folder_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = Path(stage(str(tmp_path), ".convert-"))
    (staging / "tokenizer").mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer/tokenizer.json", "DONE"):
        (staging / name).write_text(name)
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src: str, dst: str) -> None:
        events.append(("rename", str(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    publish(str(staging), str(tmp_path / "entry"), "DONE")
    rename = events.index(("rename", str(staging)))
    flushed_before = {path for kind, path in events[:rename] if kind == "fsync"}
    assert not staging.exists() and flushed_before >= {
        str(staging / "model.safetensors"), str(staging / "config.json"), str(staging / "DONE"),
        str(staging / "tokenizer" / "tokenizer.json"), str(staging / "tokenizer"), str(staging),
    }
    assert ("fsync", str(tmp_path)) in events[rename:]  # the rename itself reaches the disk
