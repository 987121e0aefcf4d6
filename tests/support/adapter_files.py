"""Adapter folders that a server must refuse without reading their config (tests of files and resolvers)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def unsafe_configs(root: Path) -> dict[str, tuple[Path, str]]:
    """Folders whose adapter_config.json must be refused unread: adapter name -> (folder, why)."""
    cases = {}
    for name, target in (("zeros", "/dev/zero"), ("random", "/dev/urandom")):
        (root / name).mkdir()
        os.symlink(target, root / name / "adapter_config.json")
        cases[name] = (root / name, "not a regular file")
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "adapter_config.json")  # no writer: a blocking open would never return
    cases["fifo"] = (root / "fifo", "not a regular file")
    (root / "huge").mkdir()
    config = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"], "padding": "x" * (2 << 20)}
    (root / "huge" / "adapter_config.json").write_text(json.dumps(config))
    cases["huge"] = (root / "huge", "larger than")
    return cases
