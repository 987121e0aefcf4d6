"""Issue 22's hostile adapters against `loraserve serve` (a child process, the filesystem resolver):
a 32-character regex that `regex` would unroll into a billion nodes (6 GB before), an
adapter_config.json nested 100k levels deep (a 500 before) and `lora_alpha: 1e38` (empty answers
before). Each is a 4xx naming the adapter, the server's peak RSS stays within 200 MB of its idle
size (counted by the kernel: VmHWM, reset after warm-up), /health answers throughout, and the server
serves normal requests afterwards. /health latency is recorded for the report and bounded only
generously (a wall-clock figure on a shared machine).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support.serve_process import ServeProcess

REGEX_BOMB = "(?:(?:(?:a{1000}){1000}){1000})"
MAX_GROWTH_MB = 200


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak(pid: int) -> bool:
    """Set VmHWM back to the current RSS (Linux clear_refs); False where that is not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def adapter_store(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("bounds")
    store = root / "store"
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapter(
        base, str(store / "good"), 5, model_dir, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    hostile = {
        "regex-bomb": lambda config: {**config, "target_modules": REGEX_BOMB},
        "huge-alpha": lambda config: {**config, "lora_alpha": 1e38},
    }
    for name, change in hostile.items():
        shutil.copytree(store / "good", store / name)
        config_file = store / name / "adapter_config.json"
        config_file.write_text(json.dumps(change(json.loads(config_file.read_text()))))
    shutil.copytree(store / "good", store / "deep-config")
    deep = '{"peft_type": "LORA", "r": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (store / "deep-config" / "adapter_config.json").write_text(deep)
    return model_dir, store


class HealthWatch:
    """Polls /health and the server's RSS on a thread until stopped; keeps every latency and status."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.rss_kb: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                self.statuses.append(http.get("/health").status_code)
                self.latencies.append(time.perf_counter() - start)
                self.rss_kb.append(_status_kb(self.pid, "VmRSS"))
                self._stop.wait(0.05)


def test_hostile_adapters_are_4xx_with_bounded_memory_and_a_live_server(adapter_store) -> None:
    model_dir, store = adapter_store
    flags = [
        model_dir, "--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "128",
        "--kv-cache-memory", "16MiB", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "true", "LORASERVE_LORA_RESOLVER_CACHE_DIR": str(store)}
    with ServeProcess(flags, env=env) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        pid = server.process.pid

        def complete(model: str) -> httpx.Response:
            return http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})

        def load(name: str, folder: str) -> httpx.Response:
            return http.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(store / folder)}
            )

        for model in ("tiny", "good", "tiny", "good"):  # warm up: the adapter path allocates once
            assert complete(model).status_code == 200
        idle_kb = _status_kb(pid, "VmRSS")
        peak_reset = _reset_peak(pid)
        with HealthWatch(server.url, pid) as watch:
            for _ in range(2):  # the second time from the failed-load memory: the same answer
                _expect(complete("regex-bomb"), 400, "'regex-bomb'", "field 'target_modules'", "regex nodes")
                _expect(load("bomb-by-path", "regex-bomb"), 400, "'bomb-by-path'", "field 'target_modules'")
                _expect(
                    load("deep-by-path", "deep-config"), 400, "'deep-by-path'", "nests 100001 levels deep"
                )
                # The resolver found the folder: its unreadable config is a 400 saying why, not a 404.
                _expect(complete("deep-config"), 400, "'deep-config'", "nests 100001 levels deep")
                _expect(complete("huge-alpha"), 400, "'huge-alpha'", "has weights whose LoRA term")
            assert complete("good").status_code == 200 and complete("tiny").status_code == 200
        peak_kb = _status_kb(pid, "VmHWM") if peak_reset else max(watch.rss_kb)
        growth_mb = (max(peak_kb, *watch.rss_kb) - idle_kb) / 1024
        print(
            f"\nidle RSS {idle_kb / 1024:.0f} MB, peak growth {growth_mb:.1f} MB "
            f"({'VmHWM' if peak_reset else 'sampled'}); /health: {len(watch.latencies)} calls, "
            f"max {max(watch.latencies) * 1000:.0f} ms, median {sorted(watch.latencies)[len(watch.latencies) // 2] * 1000:.0f} ms"
        )
        assert watch.statuses and set(watch.statuses) == {200}
        assert growth_mb < MAX_GROWTH_MB
        assert max(watch.latencies) < 5.0  # generous: the regex alone froze /health for 13.9 s
        status, output = server.stop()
    assert status == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def _expect(response: httpx.Response, status: int, *phrases: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for phrase in phrases:
        assert phrase in message, message
