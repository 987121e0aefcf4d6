"""Hostile adapters and a /health watch for the soak: the adapter configs that once cost unbounded memory
or time, loaded again and again while valid traffic runs, and how long /health takes throughout.

- `write_hostile_adapters(source, root)`: copies of a real adapter folder (its weights kept), each with
  one poisoned adapter_config.json: a regex whose compiled form expands to 10^9 states, a config nested
  100,000 levels deep, and a `lora_alpha` of 1e38 (finite, but its scaled product overflows).
- `hostile_worker`: loads each under a fresh name through the load API; every load must be a 400.
- `health_watch`: GET /health every `interval_s`; the latencies go to the tally's `health_latencies_s`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Protocol

import httpx

REGEX_BOMB = "(?:(?:(?:a{1000}){1000}){1000})"
DEEP_LEVELS = 100_000


class Tally(Protocol):
    issued: dict
    health_latencies_s: list[float]

    def record(self, kind: str, outcome: str, detail: str | None = None) -> None: ...


def _poisoned(config: dict, kind: str) -> str:
    if kind == "regex":
        return json.dumps({**config, "target_modules": REGEX_BOMB})
    if kind == "alpha":
        return json.dumps({**config, "lora_alpha": 1e38})
    body = json.dumps(config)  # deep: the real fields, then one key nested DEEP_LEVELS levels down
    return body[:-1] + ', "nest": ' + "[" * DEEP_LEVELS + "]" * DEEP_LEVELS + "}"


def write_hostile_adapters(source: str, root: str | Path) -> dict[str, str]:
    """kind -> folder: copies of `source` whose adapter_config.json is poisoned one way each."""
    config = json.loads((Path(source) / "adapter_config.json").read_text())
    folders = {}
    for kind in ("regex", "deep", "alpha"):
        folder = Path(root) / f"hostile-{kind}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
        (folder / "adapter_config.json").write_text(_poisoned(config, kind))
        folders[kind] = str(folder)
    return folders


async def hostile_worker(
    client: httpx.AsyncClient, folders: dict[str, str], tally: Tally, deadline: float, pause_s: float = 2.0
) -> None:
    """Load each hostile folder under a fresh name, in turn, until the deadline: each must get a 400."""
    number = 0
    while time.monotonic() < deadline:
        for kind, folder in folders.items():
            number += 1
            tally.issued["hostile"] += 1
            body = {"lora_name": f"hostile-{kind}-{number}", "lora_path": folder}
            try:
                response = await client.post("/v1/load_lora_adapter", json=body)
            except httpx.HTTPError as exc:
                tally.record("hostile", "unexpected", f"{kind}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code == 400:
                tally.record("hostile", "ok")
            else:
                tally.record(
                    "hostile", "unexpected", f"{kind} -> {response.status_code} {response.text[:200]}"
                )
        await asyncio.sleep(pause_s)


async def health_watch(
    client: httpx.AsyncClient, tally: Tally, deadline: float, interval_s: float = 0.1
) -> None:
    """GET /health every interval_s until the deadline; a failure counts as an unexpected outcome."""
    while time.monotonic() < deadline:
        started = time.monotonic()
        tally.issued["health"] += 1
        try:
            response = await client.get("/health")
            outcome = "ok" if response.status_code == 200 else "unexpected"
            tally.record("health", outcome, None if outcome == "ok" else f"/health -> {response.status_code}")
        except httpx.HTTPError as exc:
            tally.record("health", "unexpected", f"/health: {type(exc).__name__}: {exc}")
        tally.health_latencies_s.append(time.monotonic() - started)
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
