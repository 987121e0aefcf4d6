"""Cache folders published whole: built in a staging folder, flushed to disk, renamed into place; and
the staging folders a crash leaves behind, swept.

A converted GGUF model or a set of trained demo adapters takes minutes to build, so it is built under
a temporary name (`<prefix><pid>-<random>`) next to its final place and renamed when complete: readers
never see half a folder. Two things can still go wrong and are handled here:
- a crash (or SIGKILL) mid-build leaves the staging folder, gigabytes perhaps, that nothing would
  ever remove: each new stage first removes those of the same prefix untouched for STALE_AFTER_S
  whose owning process (the pid in the name) is gone;
- a power cut right after the rename could publish a folder whose files' data never reached the disk
  (the rename is a metadata operation): every staged file and folder is fsynced before the rename,
  and the parent folder after it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

logger = logging.getLogger(__name__)

STALE_AFTER_S = 3600.0  # longer than any build writes nothing at all


def stage(parent: str, prefix: str) -> str:
    """A new, empty staging folder `<parent>/<prefix><pid>-<random>`; stale ones of `prefix` go first."""
    os.makedirs(parent, exist_ok=True)
    sweep_stale(parent, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def sweep_stale(parent: str, prefix: str, max_age_s: float = STALE_AFTER_S) -> list[str]:
    """Remove the staging folders `<parent>/<prefix>*` whose newest entry is older than `max_age_s` and
    whose process is not alive (a name without a pid counts as ownerless); returns those removed."""
    removed: list[str] = []
    now = time.time()
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in entries:
        pid = _owner(entry.name, prefix)
        if (pid is not None and _alive(pid)) or now - _newest_mtime(entry.path) < max_age_s:
            continue
        logger.info("Removing %s, a staging folder left by a build that did not finish.", entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def publish(staging: str, folder: str, marker: str) -> None:
    """Flush a finished staging folder to disk and rename it into place; if another process published
    the same folder first (its `marker` file present), theirs stands. A half folder without the
    marker is replaced."""
    _fsync_tree(staging)
    if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, marker)):
        shutil.rmtree(folder, ignore_errors=True)
    try:
        os.replace(staging, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, marker)):
            raise
        return
    _fsync_path(os.path.dirname(os.path.abspath(folder)))  # the rename itself


def _owner(name: str, prefix: str) -> int | None:
    pid = name[len(prefix) :].partition("-")[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds the pid
        return True
    return True


def _newest_mtime(path: str) -> float:
    """The latest modification time of `path` and everything under it (a build in progress touches
    its files, not necessarily its folder)."""
    newest = 0.0
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            try:
                newest = max(newest, os.lstat(name).st_mtime)
            except OSError:
                continue
    return newest


def _fsync_tree(root: str) -> None:
    """fsync every file under `root`, then every folder, deepest first (a folder's entries are data too)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                _fsync_path(path)
        _fsync_path(folder)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
