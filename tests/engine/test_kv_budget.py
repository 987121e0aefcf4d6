"""The KV cache's size (engine/kv_budget.py): the flag, then VLLM_CPU_KVCACHE_SPACE, then a share of the
machine capped by what the scheduler could ever use; the engine logs what it chose."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraserve import LLM
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.config import CacheConfig
from loraserve.engine import kv_budget as kb

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16)
PER_BLOCK = SPEC.block_bytes(16, torch.float32)  # 2 * 2 * 16 * 2 * 16 * 4 = 8 KiB


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("LORASERVE_CPU_KVCACHE_SPACE", raising=False)


def budget(cache: CacheConfig, max_model_len: int = 256, max_num_seqs: int = 8) -> kb.KVBudget:
    return kb.kv_budget(cache, SPEC, torch.float32, "cpu", max_model_len, max_num_seqs)


def test_the_flag_and_the_blocks_option_come_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert budget(CacheConfig(kv_cache_memory_bytes=100 * PER_BLOCK)) == kb.KVBudget(
        100, 100 * PER_BLOCK, "--kv-cache-memory"
    )
    assert budget(CacheConfig(num_blocks=7)).num_blocks == 7


def test_vllms_cpu_kvcache_space_in_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    assert budget(CacheConfig()) == kb.KVBudget(
        (1 << 29) // PER_BLOCK, (1 << 29) // PER_BLOCK * PER_BLOCK, "VLLM_CPU_KVCACHE_SPACE"
    )
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="CPU_KVCACHE_SPACE"):
        budget(CacheConfig())


@pytest.mark.parametrize(
    "available, want",
    [
        (1 << 40, 8 * 16),  # plenty: what 8 sequences of 256 tokens (16 blocks each) can use
        (40 * PER_BLOCK * 4, 40),  # scarce: a quarter of what is available
        (PER_BLOCK, 16),  # never less than one sequence of max_model_len
        (None, 8 * 16),  # unreadable: the 1 GiB fallback, capped as any share
    ],
)
def test_auto_is_a_share_of_the_machine_capped_by_use(
    monkeypatch: pytest.MonkeyPatch, available: Any, want: int
) -> None:
    monkeypatch.setattr(kb, "available_memory_bytes", lambda device: available)
    got = budget(CacheConfig())
    assert (got.num_blocks, got.source) == (want, "auto")


def test_the_engine_logs_its_choice(tiny_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="loraserve.engine.kv_budget"):
        llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=128, max_num_seqs=4)
    chosen = llm.engine.kv_budget
    assert chosen.source == "auto" and chosen.num_blocks == 4 * 128 // 16  # the machine holds far more
    assert any("KV cache:" in r.getMessage() and "auto" in r.getMessage() for r in caplog.records)
    info = llm.engine.stats()["cache_config_info"]
    assert info["kv_cache_memory_bytes"] == str(chosen.bytes)


@pytest.mark.parametrize(
    "dtype, per_block",
    [
        (torch.bfloat16, PER_BLOCK // 2),
        (torch.float8_e4m3fn, PER_BLOCK // 4),
        (torch.float8_e5m2, PER_BLOCK // 4),
        (torch.int8, PER_BLOCK // 4 + 2 * 2 * 2 * 4),  # a float32 scale per (layer, K/V, KV head)
    ],
)
def test_a_block_costs_its_cache_dtypes_bytes(dtype: torch.dtype, per_block: int) -> None:
    """The same memory holds 2x (bf16) or 4x (8-bit) the float32 cache's blocks, int8's scales counted."""
    assert SPEC.block_bytes(16, dtype) == per_block
    got = kb.kv_budget(CacheConfig(kv_cache_memory_bytes=100 * PER_BLOCK), SPEC, dtype, "cpu", 256, 8)
    assert got == kb.KVBudget(100 * PER_BLOCK // per_block, 100 * PER_BLOCK // per_block * per_block, "--kv-cache-memory")


def test_the_engine_allocates_the_kv_dtype_it_was_given(tiny_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    budget_bytes = 4 << 20
    blocks = {}
    for name in ("auto", "int8"):
        with caplog.at_level("INFO", logger="loraserve.engine.kv_budget"):
            llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=128, kv_cache_dtype=name,
                      kv_cache_memory_bytes=budget_bytes)
        engine = llm.engine
        blocks[name] = engine.kv_budget.num_blocks
        cache = engine.runner.kv_caches[0]
        assert cache.dtype == (torch.float32 if name == "auto" else torch.int8)
        assert (cache.scales.k_blocks is not None) == (name == "int8")
        assert cache.k.shape[0] == blocks[name] * 16 and engine.kv_budget.bytes <= budget_bytes
        assert engine.stats()["cache_config_info"]["cache_dtype"] == name
    assert 3.5 * blocks["auto"] < blocks["int8"] <= 4 * blocks["auto"]
    assert any("KV cache:" in r.getMessage() and "int8" in r.getMessage() for r in caplog.records)
