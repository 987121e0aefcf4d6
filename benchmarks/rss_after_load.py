"""Resident memory of loraserve and of llama.cpp's `llama-server` on the same GGUF files, each in a
fresh process: after load, and after a first request (which touches every weight and the KV blocks
of one sequence), against the issue's limit of file + KV room + 10%.

loraserve's figure is the process's VmRSS minus its VmRSS just before `LLM(...)` (imports and kernel
builds done), so the Python runtime and torch do not count; llama-server's is its whole VmRSS (its
runtime is a few MB). The KV room is the one `benchmarks.beside_llama_cpp` gives both (32 slots of
160 tokens: llama.cpp's f16 bytes, loraserve's KV dtype for the same tokens). Both map the file: a
weight page touched only at load is counted while it stays resident.
Usage: python -m benchmarks.rss_after_load [--files smollm2,q4_k_m,q8_0,q4_k_m_8b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from benchmarks import measure
from benchmarks.bandwidth import read_bandwidth_gbs
from benchmarks.beside_llama_cpp import (
    SHAPES,
    SLOT_TOKENS,
    SLOTS,
    gguf_path,
    kv_room_bytes,
    our_kv_room_bytes,
)
from benchmarks.common import cpu_class, random_prompts, save_results
from benchmarks.llama_cpp import LlamaServer, rss_mb, server_binary

FIRST_REQUEST_TOKENS = 8


def _child(name: str) -> None:
    """In a fresh process: print {"load_mb", "first_request_mb"} for loraserve on `name`'s file."""
    from loraserve import LLM, SamplingParams
    from loraserve.layers.quant.kernel import kernel_library

    kernel_library()
    before = rss_mb(os.getpid())
    llm = LLM(gguf_path(name), max_model_len=SLOT_TOKENS, kv_cache_memory_bytes=our_kv_room_bytes(name))
    loaded = rss_mb(os.getpid())
    params = SamplingParams(temperature=0, max_tokens=FIRST_REQUEST_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": random_prompts(1, 16, SHAPES[name][3])[0]}], params, use_tqdm=False)
    print(json.dumps({"load_mb": loaded - before, "first_request_mb": rss_mb(os.getpid()) - before}))


def ours(name: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.rss_after_load", "--child", name]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=os.getcwd())
    return json.loads(out.stdout.strip().splitlines()[-1])


def theirs(name: str, threads: int) -> dict[str, float]:
    server = LlamaServer(gguf_path(name), threads, SLOTS, SLOT_TOKENS)
    try:
        loaded = server.rss_mb()
        server.run(random_prompts(1, 16, SHAPES[name][3]), FIRST_REQUEST_TOKENS, None)
        return {"load_mb": loaded, "first_request_mb": server.rss_mb()}
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", default="smollm2,q4_k_m,q8_0,q4_k_m_8b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tag", default="", help="saved as rss_after_load_<tag> (a CPU class's own run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child)
    bandwidth = read_bandwidth_gbs()
    measure.record_bandwidth(f"{args.threads} threads", bandwidth)
    files: dict[str, Any] = {}
    print(f"RSS, {cpu_class()}: loraserve (delta over its runtime) and llama-server (whole process), MB")
    print(
        f"{'file':<34}{'file':>7}{'KV us/them':>12}{'limit':>7}{'ours load':>10}{'ours 1st':>9}{'theirs load':>12}{'theirs 1st':>11}"
    )
    for name in args.files.split(","):
        path = gguf_path(name)
        entry: dict[str, Any] = {"file": os.path.basename(path), "file_mb": os.path.getsize(path) / 2**20,
                                 "kv_mb": our_kv_room_bytes(name) / 2**20, "their_kv_mb": kv_room_bytes(name) / 2**20,
                                 "loraserve": ours(name)}  # fmt: skip
        if server_binary() is not None:
            entry["llama.cpp"] = theirs(name, args.threads)
        entry["limit_mb"] = (entry["file_mb"] + entry["kv_mb"]) * 1.10
        files[name] = entry
        them = entry.get("llama.cpp", {})
        print(f"{entry['file']:<34}{entry['file_mb']:>7.0f}{entry['kv_mb']:>6.0f}/{entry['their_kv_mb']:<5.0f}"
              f"{entry['limit_mb']:>7.0f}{entry['loraserve']['load_mb']:>10.0f}{entry['loraserve']['first_request_mb']:>9.0f}"
              f"{them.get('load_mb', float('nan')):>12.0f}{them.get('first_request_mb', float('nan')):>11.0f}")  # fmt: skip
    save_results(
        "rss_after_load" + (f"_{args.tag}" if args.tag else ""),
        {"cpu": cpu_class(), "threads": args.threads, "files": files},
    )


if __name__ == "__main__":
    main()
