"""The KV cache's size (engine/kv_budget.py): the flag, then VLLM_CPU_KVCACHE_SPACE, then a share of the
machine capped by what the scheduler could ever use, each counted in blocks of the cache's element
dtype (`--kv-cache-dtype`, int8's block scales included); the engine allocates exactly that, logs what
it chose and reports it as vLLM's cache_config_info."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraserve import LLM
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.config import CacheConfig
from loraserve.engine import kv_budget as kb
from loraserve.engine.iteration_stats import cache_config_info
from loraserve.entrypoints.openai.metrics.vllm_metrics import vllm_engine_families

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


# What each --kv-cache-dtype's block costs: float32's SPEC block is 8 KiB; int8 adds a float32 scale per
# (layer, K/V, KV head) = 2 * 2 * 2 * 4 bytes.
BLOCK_BYTES = {
    torch.float32: PER_BLOCK,
    torch.bfloat16: PER_BLOCK // 2,
    torch.float8_e4m3fn: PER_BLOCK // 4,
    torch.float8_e5m2: PER_BLOCK // 4,
    torch.int8: PER_BLOCK // 4 + 2 * 2 * 2 * 4,
}


@pytest.mark.parametrize("dtype", list(BLOCK_BYTES), ids=str)
def test_a_block_costs_its_cache_dtypes_bytes(dtype: torch.dtype) -> None:
    """The same memory holds 2x (bf16) or 4x (8-bit) the float32 cache's blocks, int8's scales counted,
    whichever source sized it."""
    per_block = BLOCK_BYTES[dtype]
    assert SPEC.block_bytes(16, dtype) == per_block
    given = kb.kv_budget(CacheConfig(kv_cache_memory_bytes=100 * PER_BLOCK), SPEC, dtype, "cpu", 256, 8)
    fits = 100 * PER_BLOCK // per_block
    assert given == kb.KVBudget(fits, fits * per_block, "--kv-cache-memory")
    blocks = kb.kv_budget(CacheConfig(num_blocks=7), SPEC, dtype, "cpu", 256, 8)
    assert blocks == kb.KVBudget(7, 7 * per_block, "num_kv_blocks")


@pytest.mark.parametrize("dtype", list(BLOCK_BYTES), ids=str)
def test_env_and_auto_budgets_count_the_cache_dtype(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """VLLM_CPU_KVCACHE_SPACE and a scarce machine's share buy more blocks of a smaller dtype; the cap
    by use stays max_num_seqs x max_model_len tokens, so a quantized cache asks for fewer bytes."""
    per_block = BLOCK_BYTES[dtype]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    env = kb.kv_budget(CacheConfig(), SPEC, dtype, "cpu", 256, 8)
    assert (env.num_blocks, env.source) == ((1 << 29) // per_block, "VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setattr(kb, "available_memory_bytes", lambda device: 4 * 40 * PER_BLOCK)
    scarce = kb.kv_budget(CacheConfig(), SPEC, dtype, "cpu", 256, 64)
    assert scarce.num_blocks == 40 * PER_BLOCK // per_block  # a quarter of what is available
    monkeypatch.setattr(kb, "available_memory_bytes", lambda device: 1 << 40)
    plenty = kb.kv_budget(CacheConfig(), SPEC, dtype, "cpu", 256, 8)
    assert plenty == kb.KVBudget(8 * 16, 8 * 16 * per_block, "auto")


@pytest.mark.parametrize("dtype", list(BLOCK_BYTES), ids=str)
def test_the_allocated_caches_are_what_the_budget_counted(dtype: torch.dtype) -> None:
    """Every layer's K, V (and int8's block scales) together take exactly num_blocks block_bytes."""
    caches = kb.allocate_kv_caches(SPEC, 5, 16, dtype, "cpu")
    assert len(caches) == SPEC.num_layers and all(c.dtype == dtype for c in caches)
    tensors = [t for c in caches for t in (c.k, c.v, c.scales.k_blocks, c.scales.v_blocks) if t is not None]
    assert sum(t.numel() * t.element_size() for t in tensors) == 5 * SPEC.block_bytes(16, dtype)
    for cache in caches:
        assert cache.k.shape == (5 * 16, SPEC.num_kv_heads, SPEC.head_dim)
        if dtype == torch.int8:
            assert cache.scales.k_blocks is not None and cache.scales.v_blocks is not None
            assert cache.scales.k_blocks.shape == (5, SPEC.num_kv_heads)
            assert cache.scales.k_blocks.dtype == torch.float32
        else:
            assert cache.scales.k_blocks is None and cache.scales.v_blocks is None


def test_tokens_per_gib_on_a_llama_1b_shape() -> None:
    """Llama-3.2-1B's cache (16 layers, 8 KV heads of 64): float32 16,384 tokens per GiB, bf16 2x, fp8
    4x, int8 4x less its scales (4 bytes per 1,024 values: 65,280 tokens)."""
    llama = KVCacheSpec(num_layers=16, num_kv_heads=8, head_dim=64)

    def tokens(dtype: torch.dtype) -> int:
        return (1 << 30) // llama.block_bytes(16, dtype) * 16

    assert tokens(torch.float32) == 16_384
    assert tokens(torch.bfloat16) == 2 * 16_384
    assert tokens(torch.float8_e4m3fn) == tokens(torch.float8_e5m2) == 4 * 16_384
    assert tokens(torch.int8) == 65_280


@pytest.mark.parametrize(
    "name, want",
    [("auto", torch.float32), ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn),
     ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)],
)  # fmt: skip
def test_each_spelling_resolves_and_fp8_says_its_scale_is_one(
    name: str, want: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="loraserve.engine.kv_budget"):
        assert kb.kv_cache_dtype(name, torch.float32) == want
    warned = [r.getMessage() for r in caplog.records if "scaling factor 1.0" in r.getMessage()]
    assert len(warned) == (1 if name.startswith("fp8") else 0)
    if warned:
        assert name in warned[0] and f"{torch.finfo(want).max:g}" in warned[0]


def test_an_unserved_vllm_spelling_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="fp8_inc.*not served.*int8"):
        CacheConfig(kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match="'fp9' is not a KV-cache dtype"):
        kb.kv_cache_dtype("fp9", torch.float32)


def _cache_info_labels(stats: dict[str, Any]) -> dict[str, str]:
    """The labels of vllm:cache_config_info as the server's /metrics renders an engine's stats."""
    families = [f for f in vllm_engine_families(stats, "m") if f.name == "vllm:cache_config_info"]
    assert len(families) == 1 and len(families[0].samples) == 1
    return dict(families[0].samples[0].labels)


def test_cache_config_info_reports_the_flag_as_given() -> None:
    info = cache_config_info(CacheConfig(kv_cache_dtype="fp8_e4m3", block_size=32), 10, 12_345)
    assert _cache_info_labels({"cache_config_info": info}) == {
        "block_size": "32",
        "cache_dtype": "fp8_e4m3",
        "enable_prefix_caching": "True",
        "kv_cache_memory_bytes": "12345",
        "num_gpu_blocks": "10",
        "num_cpu_blocks": "None",
        "engine": "0",
    }


def test_the_engine_allocates_the_kv_dtype_it_was_given(
    tiny_model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The same --kv-cache-memory holds ~4x the blocks in int8 (its scales take 4 bytes per 64 values
    here) and 2x in bf16; the engine's caches are in that dtype, its log and /metrics say so."""
    budget_bytes = 4 << 20
    blocks = {}
    for name, dtype in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        with caplog.at_level("INFO", logger="loraserve.engine.kv_budget"):
            llm = LLM(
                tiny_model("llama"),
                dtype="float32",
                max_model_len=128,
                kv_cache_dtype=name,
                kv_cache_memory_bytes=budget_bytes,
            )
        engine = llm.engine
        chosen = blocks[name] = engine.kv_budget.num_blocks
        cache = engine.runner.kv_caches[0]
        assert cache.dtype == dtype and (cache.scales.k_blocks is not None) == (name == "int8")
        assert cache.k.shape[0] == chosen * 16
        assert 0 <= budget_bytes - engine.kv_budget.bytes < engine.kv_budget.bytes // chosen  # < one block
        assert engine.block_manager.num_free_blocks == chosen
        labels = _cache_info_labels(engine.stats())
        assert (labels["cache_dtype"], labels["num_gpu_blocks"]) == (name, str(chosen))
        assert labels["kv_cache_memory_bytes"] == str(engine.kv_budget.bytes)
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
        assert f"{chosen} blocks" in logged[-1] and str(dtype).removeprefix("torch.") in logged[-1]
    assert 2 * blocks["auto"] <= blocks["bfloat16"] <= 2 * blocks["auto"] + 1
    assert 3.5 * blocks["auto"] < blocks["int8"] <= 4 * blocks["auto"]
