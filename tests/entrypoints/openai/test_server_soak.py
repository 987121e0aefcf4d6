"""A bounded soak: the real engine with adapters behind a live server, under valid traffic, client
disconnects, bad requests (issue 39's attacks among them), served attacks, adapter churn and hostile
adapter configs (each a 400) at once, /health polled throughout. Every request is accounted for: no valid one is
lost, no bad one gets anything but a 4xx, and afterwards the engine holds no request and no KV block."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from support.harness import RunningServer, wait_for

from benchmarks.hostile_adapters import write_hostile_adapters
from benchmarks.soak_traffic import SoakPlan, run_soak_traffic
from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

SOAK_S = 15


@pytest.fixture(scope="module")
def soak_server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("soak")
    paths = {}
    for seed, name in enumerate(("sql", "mlp", "churn")):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        paths[name] = str(root / name)
        targets = ["q_proj", "v_proj"] if name != "mlp" else ["gate_proj", "up_proj", "down_proj"]
        save_peft_adapter(base, paths[name], 900 + seed, model_dir, r=4, lora_alpha=8, target_modules=targets)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=96,
            enable_lora=True,
            max_loras=2,
            max_cpu_loras=3,
            max_num_seqs=8,
            kv_cache_memory_bytes=16 << 20,
            structured_outputs_compile_timeout=1.0,
        )  # the mix's runaway regex ends in 1 s
    )
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath("sql", paths["sql"]), LoRAModulePath("mlp", paths["mlp"])],
        allow_runtime_lora_updating=True,
    )
    with RunningServer(engine, options) as server:
        yield server, paths


def test_soak_loses_nothing(soak_server: Any, tmp_path: Any) -> None:
    server, paths = soak_server
    hostile = write_hostile_adapters(paths["churn"], tmp_path)
    plan = SoakPlan(
        server.url,
        "tiny",
        ["sql", "mlp"],
        SOAK_S,
        concurrency=6,
        max_tokens=8,
        churn_adapter_path=paths["churn"],
        seed=1,
        hostile_adapters=hostile,
        watch_health=True,
    )
    tally = asyncio.run(run_soak_traffic(plan))
    summary = tally.summary()
    assert tally.num_issued == tally.num_accounted, summary
    assert not tally.lost and not tally.unexpected, summary
    assert not any(key.endswith(":refused") for key in tally.outcomes), summary
    for kind in ("valid", "valid-stream", "disconnect", "bad", "churn", "hostile", "health"):
        assert tally.issued[kind] > 0, f"the mix never sent a {kind} request: {summary}"
    stats = server.engine.stats
    wait_for(
        lambda: (s := stats()) and s["num_running"] == 0 and s["num_waiting"] == 0, what="the engine to drain"
    )
    final = stats()
    assert final["kv_blocks_free"] == final["kv_blocks_total"], final
    assert final["num_step_failures"] == 0
    assert server.http.get("/health").status_code == 200
